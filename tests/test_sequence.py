"""A sequence's token slices (the same as slicing the joined prompt and output, without joining them) and its
block table as a step reads it (one tuple while the table is unchanged, a new one once it grows, shrinks or is
rebuilt)."""

from __future__ import annotations

from dsinfer.engine.block_manager import BlockManager
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


def test_block_table_now_is_rebuilt_only_when_the_table_changed():
    prompt = list(range(40))
    seq = Sequence("r", 0, prompt, make_sampling_state(SamplingParams(), prompt, None))
    blocks = BlockManager(num_blocks=16, block_tokens=8, enable_prefix_caching=False)
    blocks.allocate(seq, 20)
    first = seq.block_table_now()
    assert first == tuple(seq.block_table) and len(first) == 3
    assert seq.block_table_now() is first  # an unchanged table: no copy
    blocks.allocate(seq, 30)  # grows: a step in flight keeps the table it read
    grown = seq.block_table_now()
    assert first == tuple(seq.block_table[:3]) and grown == tuple(seq.block_table) and len(grown) == 4
    blocks.trim(seq, 8)  # shrinks, then grows back to the same length with other blocks
    assert seq.block_table_now() == tuple(seq.block_table) and len(seq.block_table) == 1
    blocks.allocate(seq, 30)
    assert seq.block_table_now() == tuple(seq.block_table)
    blocks.free(seq)
    assert seq.block_table_now() == ()
    blocks.allocate(seq, 30)  # the same length as before the free, a new table
    assert seq.block_table_now() == tuple(seq.block_table)
