"""``dsinfer chat``: an interactive chat in the terminal, answers streamed as the engine writes them.

Each turn goes through the path ``LLM.chat`` and the server take (deepseek-recipe prompt, stream processor);
the reasoning of thinking mode is shown dimmed before the answer. ``/reset`` forgets the conversation,
``/exit`` (or Ctrl-D) leaves.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import TextIO

import deepseek_recipe as recipe

from dsinfer.chat.stream import ChoiceStream
from dsinfer.llm import LLM
from dsinfer.offline_chat import OFFLINE_MODEL_NAME, prepare_chat
from dsinfer.sampling_params import SamplingParams

DIM, RESET = "\033[2m", "\033[0m"
COMMANDS = "/reset forgets the conversation, /exit leaves"


def stream_answer(llm: LLM, messages: list[dict], params: SamplingParams,
                  thinking: bool) -> Iterator[tuple[str, str]]:  # fmt: skip
    """``("reasoning" | "content", text)`` pieces of the assistant's answer to ``messages``, as they come."""
    chat_format = llm.chat_format()
    kwargs = {"thinking": True} if thinking else None
    prepared, engine_params = prepare_chat(chat_format, messages, params, None, kwargs)
    request_id = llm.engine.add_request(prepared.prompt_ids, engine_params)
    generator = recipe.ChatCompletionRequest.chunk_generator(prepared.request, request_id, OFFLINE_MODEL_NAME)
    stream = ChoiceStream(chat_format, prepared, generator)
    try:
        while llm.engine.has_unfinished_requests():
            for output in llm.engine.step():
                if output.request_id != request_id:
                    continue
                for event in stream.push(output.outputs[0]):
                    for choice in json.loads(event.to_json()).get("choices", []):
                        delta = choice.get("delta") or {}
                        for key, kind in (("reasoning_content", "reasoning"), ("content", "content")):
                            if delta.get(key):
                                yield kind, delta[key]
            if stream.done:
                break
    finally:
        stream.close()
        if llm.engine.has_unfinished_requests():
            llm.engine.abort(request_id)


def run_chat(llm: LLM, params: SamplingParams, *, thinking: bool = False, system: str | None = None,
             read: TextIO = sys.stdin, write: TextIO = sys.stdout) -> int:  # fmt: skip
    """The read-answer loop; returns the exit status."""
    color = write.isatty()
    start: list[dict] = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    write.write(f"dsinfer chat ({COMMANDS})\n")
    while True:
        write.write("> ")
        write.flush()
        line = read.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.strip()
        if text == "/reset":
            messages = list(start)
            write.write("(conversation reset)\n")
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        answer = []
        for kind, piece in stream_answer(llm, messages, params, thinking):
            if kind == "content":
                answer.append(piece)
            write.write(f"{DIM}{piece}{RESET}" if kind == "reasoning" and color else piece)
            write.flush()
        write.write("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})
