"""``LLM.chat`` and ``dsinfer chat`` / ``generate --chat``: the server's chat path offline."""

from __future__ import annotations

import io

import httpx
import pytest
from server_harness import running_server

from dsinfer import LLM, SamplingParams
from dsinfer.chat_cli import run_chat
from dsinfer.cli import main

QUESTION = [{"role": "user", "content": "What is 12 + 35?"}]


@pytest.fixture(scope="module")
def default_llm():
    with LLM() as llm:
        yield llm


def test_chat_answers_as_the_server_does(default_llm):
    params = SamplingParams(max_tokens=48, temperature=0)
    offline = default_llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    assert "47" in offline.text and offline.finish_reason == "stop"
    with running_server(None, served_model_name="m") as (base, _):
        served = httpx.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": QUESTION, "max_tokens": 48,
                                                                  "temperature": 0}, timeout=120).json()  # fmt: skip
    assert served["choices"][0]["message"]["content"] == offline.text


def test_chat_separates_reasoning_and_tool_calls(default_llm):
    params = SamplingParams(max_tokens=24, temperature=0)
    thinking = default_llm.chat(QUESTION, params, chat_template_kwargs={"thinking": True}, use_tqdm=False)
    completion = thinking[0].outputs[0]
    assert "<think>" not in completion.text and "</think>" not in completion.text
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    batch = default_llm.chat([QUESTION, [{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=8),
                             tools=tools, use_tqdm=False)  # fmt: skip
    assert len(batch) == 2
    for output in batch:
        for call in output.outputs[0].tool_calls:
            assert call["function"]["name"] == "add"


def test_chat_command_streams_resets_and_exits(default_llm):
    typed = io.StringIO("What is 12 + 35?\n/reset\n\n/exit\nnot read\n")
    shown = io.StringIO()
    assert run_chat(default_llm, SamplingParams(max_tokens=48, temperature=0), read=typed, write=shown) == 0
    text = shown.getvalue()
    assert "47" in text and "(conversation reset)" in text and "not read" not in text


def test_generate_chat_prints_the_answer(capsys):
    assert main(["generate", "--chat", "--prompt", "What is 12 + 35?", "--max-tokens", "48"]) == 0
    printed = capsys.readouterr().out
    assert "47" in printed.splitlines()[0]
