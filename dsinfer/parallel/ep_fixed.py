"""Fixed-capacity expert-parallel dispatch: every buffer's shape is known on the host, so a decode step that
runs it can be captured in a CUDA graph (:mod:`dsinfer.parallel.graph_steps` says when the ranks use it).

Capacity. A token picks ``k`` distinct experts, so it sends at most ``min(k, L)`` slots to one rank, ``L``
being the most physical experts a rank holds (a replica of another expert is another physical expert). Every
rank therefore sends every destination a block of ``C = T * min(k, L)`` rows, ``T`` the step's token count,
which must be the same on every rank (the ranks run the same decode bucket). At EP = 1 ``C = T k``: the one
block is the step's slots in order and holds no padding.

Blocks. A destination's block is bytes: its ``C`` rows of hidden state, then their ``C`` local expert ids
(int64), then their ``C`` mixing weights (float32), each part 8-byte aligned. Dispatch is one
``all_to_all_single`` of equal splits and combine is another. Slot ``s`` for rank ``d`` takes place ``p`` of
block ``d``, ``p`` the number of earlier slots for ``d`` (a cumulative sum over a one-hot ``[T k, ranks]``, no
sort). At EP = 1 the block is the slots in order: the receiver reads the rows, ids and weights in place.

Padding. The places of a block past its real count stay zero: local expert 0, weight 0, input 0. The receiver
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


def block_capacity(tokens: int, top_k: int, most_local_experts: int) -> int:
    """Rows every rank sends every destination for a step of ``tokens`` tokens (see the module docstring)."""
    return tokens * min(top_k, most_local_experts)


class _Blocks:
    """Views of one destination's (or source's) rows, ids and weights in a ``uint8 [ranks, block]`` buffer."""

    def __init__(self, capacity: int, hidden: int, dtype: torch.dtype) -> None:
        self.capacity, self.hidden, self.dtype = capacity, hidden, dtype
        self.row_bytes = capacity * hidden * torch.empty((), dtype=dtype).element_size()
        self.ids_at = _align(self.row_bytes)
        self.weights_at = self.ids_at + 8 * capacity
        self.size = _align(self.weights_at + 4 * capacity)

    def rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[ranks, C, H]`` in the activations' dtype."""
        return buffer[:, : self.row_bytes].view(self.dtype).view(buffer.shape[0], self.capacity, self.hidden)

    def ids(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[:, self.ids_at : self.weights_at].view(torch.int64)

    def weights(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[:, self.weights_at : self.weights_at + 4 * self.capacity].view(torch.float32)


def _align(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def dispatch_fixed(
    ep: ExpertParallel, moe: MoE, x: torch.Tensor, physical: torch.Tensor, expert_weights: torch.Tensor
) -> torch.Tensor:
    """The routed part of ``moe`` for ``x [T, H]`` whose slots (token-major, ``[T k]``) go to the physical
    experts ``physical``; ``[T, H]`` in ``x.dtype``. Every rank must call it with the same ``T``."""
    tokens, hidden = x.shape
    top_k = expert_weights.shape[1]
    ranks = ep.ep_size
    capacity = block_capacity(tokens, top_k, ep.most_local_experts)
    blocks = _Blocks(capacity, hidden, x.dtype)
    if ranks == 1:  # the one block is the slots in order; with one rank the local id is the physical id
        send = torch.empty(1, blocks.size, dtype=torch.uint8, device=x.device)
        blocks.rows(send)[0].view(tokens, top_k, hidden).copy_(x[:, None, :])
        blocks.ids(send)[0].copy_(physical)
        blocks.weights(send)[0].copy_(expert_weights.reshape(-1))
        index = None
    else:
        destination = ep.phys_rank.index_select(0, physical)
        onehot = destination[:, None] == ep.rank_ids[None, :]
        place = onehot.cumsum(0).gather(1, destination[:, None]).squeeze(1) - 1
        send = torch.zeros(ranks, blocks.size, dtype=torch.uint8, device=x.device)
        slot_rows = x[:, None, :].expand(tokens, top_k, hidden).reshape(-1, hidden)
        blocks.rows(send)[destination, place] = slot_rows
        blocks.ids(send)[destination, place] = ep.phys_local_ids.index_select(0, physical)
        blocks.weights(send)[destination, place] = expert_weights.reshape(-1)
        index = destination * capacity + place
    received = _exchange(ep, send)
    rows = blocks.rows(received).reshape(-1, hidden)  # in place at one rank, gathered from the blocks at more
    local_ids = blocks.ids(received).reshape(-1, 1)
    weights = blocks.weights(received).reshape(-1, 1)
    out = routed_rows(moe, rows, local_ids, weights)
    back = _exchange(ep, out)
    if index is not None:
        back = back.index_select(0, index)
    return back.view(tokens, top_k, hidden).sum(dim=1)


def routed_rows(moe, rows: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The ``routed_moe`` op over the rank's experts for received rows (staged first when they are offloaded)."""
    if getattr(moe, "expert_residency", None) is not None:
        return moe.run_routed(rows, local_ids, weights)
    return moe.ops.routed_moe(rows, moe.routed_weights(), local_ids, weights, moe.swiglu_limit)


def _exchange(ep: ExpertParallel, send: torch.Tensor) -> torch.Tensor:
    """Block ``d`` of ``send`` to rank ``d``; block ``s`` of the result came from rank ``s`` (equal splits)."""
    if ep.static_group is None:  # one rank without torch.distributed: the exchange is the identity
        return send
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send.contiguous(), group=ep.static_group)
    return received
