"""The shipped default model through ``dsinfer serve`` (no model argument) and the openai client: it is the
trained small V4.1, and it answers in the trained forms (a greeting, the reasoning in thinking mode, a call to the
tool the question needs, JSON for the requested schema). The held-out accuracies are measured by
``scripts/eval_default.py`` (docs/default-model.md)."""

from __future__ import annotations

import json

import openai
import pytest
from server_harness import running_server

from dsinfer.config import EngineConfig
from dsinfer.models.tiny import default_model_dir
from dsinfer.training import corpus


@pytest.fixture(scope="module")
def client():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=2048)
    with running_server(None, config, served_model_name=None) as (base, _engine):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _reply(client, sample: corpus.Sample):
    reply = client.chat.completions.create(
        model="dsinfer-default-v41", max_tokens=200, temperature=0, **sample.chat_arguments()
    )
    return reply.choices[0]


def test_the_default_is_the_trained_v41():
    config = json.loads((default_model_dir() / "config.json").read_text())
    training = json.loads((default_model_dir() / "training.json").read_text())
    assert config["model_type"] == "deepseek_v41"
    assert training["history"][-1]["loss"] < 0.5 < training["history"][0]["loss"]
    assert sum(f.stat().st_size for f in default_model_dir().iterdir()) < 30 * 2**20


def test_a_greeting_gets_a_short_clean_reply(client):
    choice = _reply(client, corpus.held_out("greetings", 1)[0])
    text = choice.message.content
    assert choice.finish_reason == "stop" and 0 < len(text) < 200
    assert "\ufffd" not in text and "<｜" not in text


def test_thinking_mode_reasons_and_calls_the_tool_the_question_needs(client):
    for sample in corpus.held_out("tools", 2):
        choice = _reply(client, sample)
        assert choice.message.reasoning_content
        assert choice.finish_reason == "tool_calls"
        assert [call.function.name for call in choice.message.tool_calls] == [sample.expected["name"]]
        assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == set(sample.expected["arguments"])


def test_extraction_writes_json_of_the_requested_schema(client):
    sample = corpus.held_out("extraction", 1, thinking=False)[0]
    data = json.loads(_reply(client, sample).message.content)
    assert set(data) == {"name", "age", "city"} and data["age"] == sample.expected["age"]
