"""Text in the API process: the ranks send token ids, this turns them into text and applies stop strings.

Only here are tokens turned into text (the ranks run with ``detokenize=False``), once, and only for requests that
want it: a request with ``detokenize=False`` (chat, Responses, Messages: the protocol library decodes the ids)
keeps its ids alone.

The rules are the single-rank engine's (:meth:`dsinfer.engine.engine.LLMEngine._update_text`), applied token
by token in the order the rank produced them: a stop token the rank marks hidden stays out of the text, a
stop string is searched only where a new match can start, and a stop string found with the last allowed
token turns ``length`` into ``stop``. A stop string found before the rank's own end finishes the completion
here; tokens the rank produced after it (it learns of the stop one step later) are dropped, so the token ids
are those of one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsinfer.engine.detokenizer import IncrementalDetokenizer
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.outputs import CompletionOutput
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer


@dataclass
class _StopView:
    """The fields ``LLMEngine._apply_stop_strings`` reads and writes."""

    text: str


class CompletionText:
    """One completion's text as its tokens arrive."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, output: CompletionOutput) -> None:
        self.params, self.output = params, output
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stopped_here = False  # a stop string ended it before the rank did

    def push(self, token_id: int, finish_reason: str | None, hide: bool, logprob=None, top_logprobs=None) -> bool:
        """Take one token (``finish_reason``: the rank's, with the last token); True when a stop string
        ended the completion before the rank did (the rank must be told)."""
        if self.output.finish_reason is not None:
            return False  # ended here already: a token the rank produced before it heard
        output, params = self.output, self.params
        output.token_ids.append(token_id)
        if logprob is not None:
            if output.logprobs is None:
                output.logprobs = []
            output.logprobs.append(logprob)
        if top_logprobs is not None:
            if output.top_logprobs is None:
                output.top_logprobs = []
            output.top_logprobs.append(top_logprobs)
        if not params.detokenize:  # the caller decodes the ids itself (chat): no text, no stop strings
            output.finish_reason = finish_reason
            return False
        visible = len(output.token_ids) - (1 if hide else 0)
        searched_from = len(output.text)
        text = output.text + self.detokenizer.push(output.token_ids[len(self.detokenizer.ids) : visible])
        if finish_reason is not None:
            text += self.detokenizer.flush()
        view = _StopView(text)
        if (
            params.stop
            and finish_reason in (None, "length")
            and len(output.token_ids) >= params.min_tokens
            and LLMEngine._apply_stop_strings(view, params, searched_from)
        ):
            output.text = view.text
            if finish_reason is None:
                self.detokenizer.flush()
                output.finish_reason = "stop"
                self.stopped_here = True
                return True
            finish_reason = "stop"  # the stop string came with the last allowed token
        output.text = view.text
        output.finish_reason = finish_reason
        return False
