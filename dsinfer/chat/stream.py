"""Engine outputs through deepseek-recipe's stream processor: one choice's tokens in, the library's chunks out.

The library's ``StreamProcessor`` turns generated tokens into Chat Completions chunks, Responses events or
Messages events: reasoning until ``</think>``, DSML tool calls, stop sequences (answer text only), finish
reasons and usage. :class:`ChoiceStream` feeds it the engine's tokens, one processor per choice, and keeps control
tokens away from it: an added token other than ``</think>`` (in thinking mode) and the DSML marker (when
the request has tools) is counted but never decoded, so ``<｜User｜>``, ``<think>`` or bos can never reach
``content`` or ``reasoning_content``. The server and the offline ``LLM`` both parse through it.
"""

from __future__ import annotations

import deepseek_recipe as recipe

from dsinfer.chat.format import ChatFormat, PreparedRequest
from dsinfer.engine.outputs import CompletionOutput

__all__ = ["ChoiceStream"]

_FINISH_REASONS = {"stop": recipe.InferenceFinishReason.Stop, "length": recipe.InferenceFinishReason.Length}


class ChoiceStream:
    """One choice's tokens through one library stream processor."""

    def __init__(self, chat_format: ChatFormat, prepared: PreparedRequest, generator) -> None:
        self._processor = recipe.StreamProcessor(generator, prepared.parsing_options, chat_format.recipe_tokenizer)
        # </think> ends reasoning only in thinking mode; otherwise the prompt already closed it, and the library
        # would take a generated one for text (a tool argument "</think>imgrad").
        meaningful = {chat_format.think_end_id} if prepared.thinking else set()
        if prepared.parses_tool_calls:
            meaningful.add(chat_format.dsml_id)
        self._hidden = chat_format.control_ids - meaningful
        self._prompt_tokens = len(prepared.prompt_ids)
        self._started = False
        self._sent = 0  # tokens of the completion already pushed
        # Control tokens kept from the parser: usage adds them (the server's usage_with_hidden).
        self.hidden_tokens = 0

    @property
    def done(self) -> bool:
        return self._processor.finished

    def push(self, completion: CompletionOutput) -> list:
        """The library's chunks for what ``completion`` (cumulative, as the engine reports it) added."""
        if self.done:
            return []
        events: list = []
        if not self._started:
            self._started = True
            events += self._processor.push(
                recipe.InferenceChunk.ready(prompt_usage=recipe.PromptUsage(prompt_tokens=self._prompt_tokens))
            )
        start, self._sent = self._sent, len(completion.token_ids)
        run: list[int] = []
        run_logprobs: list = []

        def flush() -> None:
            # One token per chunk, whatever the engine step delivered: the library holds back a chunk whose
            # text ends inside a UTF-8 character as a whole, so batching would change what a stream shows.
            for offset, token in enumerate(run):
                if self.done:
                    break
                logprobs = [run_logprobs[offset]] if completion.logprobs is not None else None
                events.extend(self._processor.push(recipe.InferenceChunk.tokens([token], logprobs)))
            run.clear()
            run_logprobs.clear()

        for position in range(start, len(completion.token_ids)):
            token = completion.token_ids[position]
            if token in self._hidden:
                # Not pushed at all: an empty text chunk would make the library drop the bytes it holds back.
                self.hidden_tokens += 1
                continue
            run.append(token)
            if completion.logprobs is not None:
                tops = completion.top_logprobs[position] if completion.top_logprobs else []
                run_logprobs.append((completion.logprobs[position], list(tops)))
        flush()
        if completion.finish_reason is not None and not self.done:
            reason = _FINISH_REASONS.get(completion.finish_reason)
            if reason is not None:
                events += self._processor.push(recipe.InferenceChunk.finish(reason))
            events += self._processor.finish()
        return events

    def close(self) -> None:
        if not self.done:
            self._processor.close()
