"""The truth for V4.1's selections over index scores [n, W] (ties -> the lowest index, as every top-k here).

* ``index_topk_decode(scores, k, allowed)``: each row's ``min(k, W)`` best entries among those ``allowed`` (None:
  all) with a finite score, in ascending entry order, then -1 padding: the decode attention's entry list.
* ``candidate_block_mask(scores, visible_counts, topk_blocks, block_size)``: the entries of each row's best
  ``topk_blocks`` blocks (a block scores its best entry; the block of the newest visible entry always kept,
  blocks with no finite score never).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.index_scores.reference import top_k_in_order
from dsinfer.ops.registry import REFERENCE, register
from dsinfer.ops.topk import topk_indices


@register("index_topk_decode", REFERENCE)
def index_topk_decode_reference(scores: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Entry numbers [n, min(k, W)] (int64): the chosen ones ascending, then -1."""
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    chosen, real = top_k_in_order(scores, k)
    return torch.where(real, chosen, -1)


@register("candidate_block_mask", REFERENCE)
def candidate_block_mask_reference(
    scores: torch.Tensor, visible_counts: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Boolean mask shaped like ``scores`` [n, W]: the entries of each row's best ``topk_blocks`` blocks."""
    width = scores.shape[-1]
    if width == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    block_scores = candidate_block_scores(scores, visible_counts, block_size)
    num_blocks = block_scores.shape[-1]
    chosen = topk_indices(block_scores, min(topk_blocks, num_blocks))
    finite = block_scores.gather(-1, chosen) > float("-inf")
    keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, chosen, finite)
    return keep.repeat_interleave(block_size, dim=-1)[..., :width]


def candidate_block_scores(scores: torch.Tensor, visible_counts: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each block's score [n, ceil(W / block_size)]: its best entry's, +inf for the block of the newest visible
    entry (always kept), -inf for a block with no finite score."""
    tail = -scores.shape[-1] % block_size
    padded = F.pad(scores, (0, tail), value=float("-inf")) if tail else scores  # no copy of a whole row of blocks
    block_scores = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    newest = (visible_counts - 1).div(block_size, rounding_mode="floor")
    block_ids = torch.arange(block_scores.shape[-1], device=scores.device)
    return block_scores.masked_fill_(block_ids == newest[:, None], float("inf"))
