"""A sequence's token slices: the same as slicing the joined prompt and output, without joining them."""

from __future__ import annotations

from dsinfer.engine.sequence import Sequence
from dsinfer.sampling.sampler import make_sampling_state
from dsinfer.sampling_params import SamplingParams


def test_tokens_between_equals_slicing_the_joined_tokens():
    prompt = list(range(100, 107))
    seq = Sequence("r", 0, prompt, make_sampling_state(SamplingParams(), prompt, None))
    seq.output_token_ids.extend([7, 8, 9])
    joined = seq.token_ids
    for start in range(len(joined) + 1):
        for end in range(start, len(joined) + 2):
            assert seq.tokens_between(start, end) == joined[start:end], (start, end)
    assert seq.tokens_between(2, 4) is not prompt  # a new list: the caller may extend it
