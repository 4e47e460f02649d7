"""Training samples as token ids, rendered exactly as ``dsinfer serve`` renders requests.

The prompt is the server's own: :meth:`ChatFormat.prepare` over the sample's request body (deepseek-recipe's
V4.1 encoding, generation prompt included). The completion is what the model must write after it, in the
form the server's output parser reads: in thinking mode the reasoning, ``</think>``, then the answer; tool
calls as the DSML block the library itself renders for an assistant turn in the conversation history; the
end-of-sentence token last.
"""

from __future__ import annotations

import json

from dsinfer.chat.format import ChatFormat
from dsinfer.tokenizer import EOS_TOKEN, THINK_END_TOKEN
from dsinfer.training.corpus import Completion, Sample

__all__ = ["SampleRenderer"]


class SampleRenderer:
    def __init__(self, chat_format: ChatFormat) -> None:
        self.chat_format = chat_format
        self.tokenizer = chat_format.tokenizer

    def prompt_ids(self, sample: Sample) -> list[int]:
        return self.chat_format.prepare("chat", sample.body).prompt_ids

    def completion_text(self, sample: Sample) -> str:
        completion = sample.completion
        answer = self._tool_block(sample.body, completion) if completion.tool_calls else completion.content + EOS_TOKEN
        if sample.thinking:
            return completion.reasoning + THINK_END_TOKEN + answer
        return answer

    def encode(self, sample: Sample) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids) of one sample."""
        return self.prompt_ids(sample), self.tokenizer.encode(self.completion_text(sample), allow_special=True)

    def _tool_block(self, body: dict, completion: Completion) -> str:
        """The library's rendering of the calls as a history turn: the text after ``</think>`` up to eos."""
        calls = [{"id": f"call_{i}", "type": "function",
                  "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}
                 for i, call in enumerate(completion.tool_calls)]  # fmt: skip
        results = [{"role": "tool", "tool_call_id": call["id"], "content": "{}"} for call in calls]
        chat = {**body, "thinking": {"type": "disabled"}}
        prefix = self._render(chat)
        full = self._render({**chat, "messages": [*body["messages"], {"role": "assistant", "content": None,
                                                                      "tool_calls": calls}, *results]})  # fmt: skip
        if not full.startswith(prefix):
            raise RuntimeError("the chat format does not render a conversation's history as a prefix of it")
        return full[len(prefix) : full.index(EOS_TOKEN, len(prefix)) + len(EOS_TOKEN)]

    def _render(self, body: dict) -> str:
        return self.chat_format.render(self.chat_format.prepare("chat", body).request.conversation)
