"""From sampled tokens to what a caller reads: the stop rules, the text, and each request's output.

Every engine applies the same rules here, so a request ends the same way in one process or in several:

- the rules that need no text (a stop token, the grammar's end, ``max_tokens``, the context length) run where
  the token is sampled: :func:`finish_reason_after_token`, on the engine's :class:`Sequence`;
- the rules that need text run where the text is made: :class:`CompletionText` detokenizes incrementally and
  cuts at the first stop string. The single-rank engine keeps one per sequence; the ranked engine
  (:mod:`dsinfer.parallel.ranked_engine`) rebuilds each completion from the token ids the ranks report through
  :class:`ReportedCompletion`, which feeds the same :class:`CompletionText` token by token;
- :func:`completion_output` and :func:`request_output` build the :class:`RequestOutput` both engines return.

A stop token is left out of the text (``hide_last_token``); a stop string is searched only where a new match can
start; a stop string found with the last token a length limit allows turns ``length`` into ``stop``; a stop token
or the grammar's end leaves the text whole (no stop string is searched).
"""

from __future__ import annotations

import logging

from dsinfer.engine.detokenizer import IncrementalDetokenizer
from dsinfer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from dsinfer.engine.sequence import Sequence
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

log = logging.getLogger("dsinfer.engine")


def finish_reason_after_token(seq: Sequence, max_model_len: int) -> str | None:
    """The stop rules that need no text, for the token just appended to ``seq.output_token_ids``.

    The grammar takes the token first: one it forbids ends the sequence with ``abort`` (never the engine).
    Sets ``seq.hide_last_token`` when the token is a stop token (counted once ``min_tokens`` are out), which the
    text leaves out. Returns the finish reason, or None while the sequence goes on.
    """
    token, produced = seq.output_token_ids[-1], len(seq.output_token_ids)
    constraint, params = seq.sampling.constraint, seq.sampling.params
    seq.hide_last_token = token in seq.sampling.stop_token_ids and produced >= params.min_tokens
    if constraint is not None:
        try:
            constraint.accept(token)
        except ValueError:
            log.warning("request %s produced a token its grammar forbids; ending it", seq.request_id)
            return "abort"
    if seq.hide_last_token or (constraint is not None and constraint.is_terminated()):
        return "stop"
    if (params.max_tokens is not None and produced >= params.max_tokens) or seq.num_tokens >= max_model_len:
        return "length"
    return None


def cut_at_stop_string(text: str, stops: list[str], include_stop: bool, searched_from: int) -> str | None:
    """``text`` cut at its first stop string (kept only with ``include_stop``), or None when none is in it.

    Only text that could hold a new match is searched: from ``searched_from`` (where the text ended before
    the newest tokens) minus the longest stop string, so a stop string that spans token boundaries is found
    once its last piece arrives.
    """
    longest = max((len(stop) for stop in stops if stop), default=0)
    begin = max(0, searched_from - longest + 1)
    hits = [(position, stop) for stop in stops if stop and (position := text.find(stop, begin)) >= 0]
    if not hits:
        return None
    position, stop = min(hits)
    return text[: position + len(stop) if include_stop else position]


class CompletionText:
    """One completion's text as its tokens arrive: incremental detokenization, then the stop strings.

    Nothing is made for a request with ``detokenize=False`` (the caller decodes the ids; such a request has
    no stop strings either).
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.params = params
        self.text = ""
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens) if params.detokenize else None

    def update(self, token_ids: list[int], hide_last: bool, finish_reason: str | None) -> bool:
        """Take the ids appended since the last call (``token_ids`` is the whole output so far); True when a
        stop string matched, the text then ends there and the completion must end with ``stop``.

        ``hide_last``: the last id is a stop token, left out of the text. ``finish_reason``: how the completion
        ended so far (None while it runs); once it has ended, text held back for an unfinished character is
        flushed, and only a ``length`` end may still turn into a stop string's."""
        detokenizer, params = self.detokenizer, self.params
        if detokenizer is None:
            return False
        visible = len(token_ids) - (1 if hide_last else 0)
        searched_from = len(self.text)
        self.text += detokenizer.push(token_ids[len(detokenizer.ids) : visible])
        if finish_reason is not None:
            self.text += detokenizer.flush()
        if not params.stop or finish_reason not in (None, "length") or len(token_ids) < params.min_tokens:
            return False
        cut = cut_at_stop_string(self.text, params.stop, params.include_stop_str_in_output, searched_from)
        if cut is None:
            return False
        self.text = cut
        return True


class ReportedCompletion:
    """A completion rebuilt from the token ids an engine process reports, with its text made here.

    The engine process runs with ``detokenize=False`` and no stop strings; it reports each token with its
    finish reason (on the last one) and whether that last token is a hidden stop token. A stop string found
    here ends the completion before the engine process knows: :meth:`push` says so, and tokens it produced
    after that (it hears one step later) are dropped, so the ids are those one engine would have given.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, index: int) -> None:
        self.output = CompletionOutput(index, "", [], None)
        self.text = CompletionText(tokenizer, params)

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None

    def push(self, token_id: int, finish_reason: str | None, hide: bool, logprob=None, top_logprobs=None) -> bool:
        """Take one token (``finish_reason``: the engine process's, with its last token); True when a stop
        string ended the completion here before the engine process did (it must be told)."""
        output = self.output
        if output.finish_reason is not None:
            return False  # ended here already: a token produced before the engine process heard
        output.token_ids.append(token_id)
        if logprob is not None:
            output.logprobs = [] if output.logprobs is None else output.logprobs
            output.logprobs.append(logprob)
        if top_logprobs is not None:
            output.top_logprobs = [] if output.top_logprobs is None else output.top_logprobs
            output.top_logprobs.append(top_logprobs)
        stopped = self.text.update(output.token_ids, hide, finish_reason)
        output.text = self.text.text
        output.finish_reason = "stop" if stopped else finish_reason
        return stopped and finish_reason is None

    def snapshot(self) -> CompletionOutput:
        """A copy to hand out (this one keeps growing)."""
        out = self.output
        return completion_output(out.index, out.text, out.token_ids, out.finish_reason, out.logprobs, out.top_logprobs)


def completion_output(
    index: int,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    logprobs: list[float] | None,
    top_logprobs: list[list[tuple[int, float]]] | None,
) -> CompletionOutput:
    """A completion as a caller may keep it: the lists are copies (the engine keeps appending to its own)."""
    return CompletionOutput(
        index, text, list(token_ids), finish_reason,
        None if logprobs is None else list(logprobs),
        None if top_logprobs is None else list(top_logprobs),
    )  # fmt: skip


def request_output(
    request_id: str, prompt_token_ids: list[int], completions: list[CompletionOutput], metrics: RequestMetrics
) -> RequestOutput:
    """A request's output; finished once every completion has a finish reason.

    The prompt list is shared, not copied (an 8k prompt copied for every stream at every step cost more than a
    step's other bookkeeping); nothing changes a request's prompt once it is added."""
    finished = all(c.finish_reason is not None for c in completions)
    return RequestOutput(request_id, prompt_token_ids, completions, finished, metrics)
