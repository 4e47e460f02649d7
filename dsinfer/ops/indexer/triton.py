"""The lightning indexer's decode step in Triton: the split-K scores kernel, then the batched top-k.

The reference gathers every entry slot of every block table into a [B, W, d] tensor, then forms the per-head
products [B, nh, W] in memory before weighting and summing them, then chooses through the packed-key top-k and two
sorts. Here the scores are ``index_scores_paged``'s kernel (a grid of sequences x chunks of slots, each key read
once where the pool keeps it, plain bf16 or FP8 / FP4 codes decoded in registers, the heads' products on the
tensor cores) and the choice is ``index_topk_decode``'s (one program per row, or per chunk of a long row and one
more to merge the chunks' candidates): the same entries in the same order, the lowest entry on ties. Where a slot
is not real its entry number is -1 here (the reference leaves some unseen slot's number there); the attention
reads only the real ones. Scores agree with the reference's to float32 rounding (``tests/ops/test_index_decode.py``).
"""

from __future__ import annotations

import torch

from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs
from dsinfer.ops.index_scores_paged.triton import paged_scores_launch, serves
from dsinfer.ops.index_select.triton import index_topk_decode_triton
from dsinfer.ops.indexer.reference import indexer_topk_decode_reference
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import triton_available


def indexer_scores_launch(inputs: PagedIndexInputs) -> torch.Tensor:
    """Scores [B, max_blocks * per_block] float32, -inf past each sequence's ``visible`` entries (no fallback)."""
    return paged_scores_launch(inputs)


def choose_visible(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``select_visible_topk`` on scores that are -inf past each row's visible entries: the chosen
    entries [B, min(k, W)] in position order (-1 where not real) and which are real."""
    chosen = index_topk_decode_triton(scores, k)
    return chosen, chosen >= 0


@register(
    "indexer_topk_decode",
    "triton",
    devices=("cuda",),
    available=triton_available,
    priority=10,
)
def indexer_topk_decode_triton(inputs: PagedIndexInputs, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference; inputs the kernels do not take go to the reference (a kernel that fails to
    compile here is the registry's to fall back from)."""
    q, keys, key_scales = inputs.q, inputs.keys, inputs.key_scales
    if not serves(q, keys, key_scales):
        return indexer_topk_decode_reference(inputs, k)
    return choose_visible(indexer_scores_launch(inputs), k)
