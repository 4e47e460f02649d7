"""Fixed-capacity expert-parallel dispatch: every buffer's shape is known on the host, so a decode step that
runs it can be captured in a CUDA graph (:mod:`dsinfer.parallel.graph_steps` says when the ranks use it).

Capacity. A token picks ``k`` distinct experts, so it sends at most ``min(k, L)`` slots to one rank, ``L``
being the most physical experts a rank holds (a replica of another expert is another physical expert). Every
rank therefore sends every destination a block of ``C = T * min(k, L)`` rows, ``T`` the step's token count,
which must be the same on every rank (the ranks run the same decode bucket). At EP = 1 ``C = T k``: the one
block is the step's slots in order and holds no padding.

Rows. A slot's row travels with its metadata (the destination's local expert id and the mixing weight, two
float32 values viewed as ``x.dtype`` columns at the end of the row), so dispatch is one ``all_to_all_single``
with equal splits and combine is another. Slot ``s`` for rank ``d`` lands in row ``d C + p``, ``p`` the number
of earlier slots for ``d`` (a cumulative sum over a one-hot ``[T k, ranks]``, no sort).

Padding. The rows of a block past its real count stay zero: local expert 0, weight 0, input 0. The receiver
runs ``routed_moe`` over its whole buffer, one expert per row, and the op computes every row independently
of the others (each row is its own token), so a padding row changes no real row's output; it comes back
zero (``w2 (silu(0) * 0) = 0``, times weight 0) and the sender's combine never reads it. The receiver needs
no counts (the metadata marks the padding), which saves the count exchange the variable-size path needs
for its split sizes. What padding costs: at EP > 1 a padding row is a real row of local expert 0 to the
routed-experts backend (it adds ``ceil(padding / BLOCK_M)`` blocks of that expert), since no backend skips
an out-of-range expert id today (``sort_slots`` counts with ``scatter_add_`` into ``E`` bins). At EP = 1
there is none.

Combine. The sender gathers its slots' rows back in slot order and sums each token's ``k`` rows
(``view(T, k, H).sum(1)``): the order the Triton routed-experts backend sums a token's slots in, so at EP = 1
the step adds the same bf16 values as the single-rank op does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from dsinfer.layers.moe import MoE
    from dsinfer.parallel.ep import ExpertParallel

META_FLOATS = 2  # float32 values a row carries after its hidden state: local expert id, mixing weight


def block_capacity(tokens: int, top_k: int, most_local_experts: int) -> int:
    """Rows every rank sends every destination for a step of ``tokens`` tokens (see the module docstring)."""
    return tokens * min(top_k, most_local_experts)


def meta_columns(dtype: torch.dtype) -> int:
    """Columns of ``dtype`` that hold a row's two float32 metadata values."""
    size = torch.empty((), dtype=dtype).element_size()
    if (META_FLOATS * 4) % size:
        raise ValueError(f"expert-parallel rows of {dtype} cannot carry float32 metadata")
    return META_FLOATS * 4 // size


def dispatch_fixed(
    ep: ExpertParallel, moe: MoE, x: torch.Tensor, physical: torch.Tensor, expert_weights: torch.Tensor
) -> torch.Tensor:
    """The routed part of ``moe`` for ``x [T, H]`` whose slots (token-major, ``[T k]``) go to the physical
    experts ``physical``; ``[T, H]`` in ``x.dtype``. Every rank must call it with the same ``T``."""
    tokens, hidden = x.shape
    top_k = expert_weights.shape[1]
    ranks = ep.ep_size
    meta = torch.stack([ep.phys_local.index_select(0, physical), expert_weights.reshape(-1)], dim=1)
    slots = torch.cat([x[:, None, :].expand(tokens, top_k, hidden).reshape(-1, hidden), meta.view(x.dtype)], dim=1)
    if ranks == 1:  # one destination takes every slot in slot order: the block is ``slots`` itself
        send, index = slots, None
    else:
        capacity = block_capacity(tokens, top_k, ep.most_local_experts)
        destination = ep.phys_rank.index_select(0, physical)
        onehot = destination[:, None] == ep.rank_ids[None, :]
        place = onehot.cumsum(0).gather(1, destination[:, None]).squeeze(1) - 1
        index = destination * capacity + place
        send = slots.new_zeros(ranks * capacity, slots.shape[1])
        send.index_copy_(0, index, slots)
    received = _exchange(ep, send)
    received_meta = received[:, hidden:].contiguous().view(torch.float32)
    local_ids = received_meta[:, :1].long()
    out = moe.ops.routed_moe(
        received[:, :hidden], moe.routed_weights(), local_ids, received_meta[:, 1:].contiguous(), moe.swiglu_limit
    )
    back = _exchange(ep, out)
    if index is not None:
        back = back.index_select(0, index)
    return back.view(tokens, top_k, hidden).sum(dim=1)


def _exchange(ep: ExpertParallel, send: torch.Tensor) -> torch.Tensor:
    """Block ``d`` of ``send`` to rank ``d``; block ``s`` of the result came from rank ``s`` (equal splits)."""
    if ep.group is None:  # one rank without torch.distributed: the exchange is the identity
        return send
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send.contiguous(), group=ep.group)
    return received
