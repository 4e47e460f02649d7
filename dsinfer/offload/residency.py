"""One offloaded layer: which of its experts live on the GPU, where every expert is read from, and its fetches.

The layer's table ``slot_of_expert [E]`` names an arena entry for every expert, and changes only at a re-balance
(between steps): a resident expert's slot, or for an offloaded expert a fixed row of the layer's fetch buffer
(its rank among the offloaded ids). So the ``routed_moe`` op reads every chosen expert through a table whose
contents a captured step never has to change; a step only has to fill the fetch rows it reads.

:meth:`LayerResidency.stage` does that on the device with fixed-size tensors, no host read: the
``offload_fetch_list`` op turns the router's top-k ids into the experts chosen, of them those neither resident nor
already fetched ahead, and the list over the layer's offloaded experts (an entry per fetch row, -1 where the expert
is not needed), keeping the routing counts and traffic counters as it goes (one program on CUDA); then one
``copy_expert_rows`` call a part copies the listed rows. Then, with fetch-ahead on, it starts the next offloaded
layer's fetch: that layer's router run on this layer's MoE input predicts its choices (exactly, for V4's hash-routed
layers), and the predicted misses are copied on the copy stream while this layer's experts and the next layer's
attention compute. When the next layer stages, the compute stream waits for that copy and fetches only what the
prediction missed. A prefill chunk routes to most experts, so it streams each layer's offloaded experts one layer
ahead the same way.

On the CPU host and device are one memory and there is one stream: the same masks, lists and copies run in
program order, which is how the CPU tests check this path against every expert resident.
"""

from __future__ import annotations

import torch

from dsinfer.offload.arena import ExpertArena
from dsinfer.offload.host_store import PARTS, HostStore
from dsinfer.offload.stats import ExpertStats
from dsinfer.ops.fetch_list import FetchListInputs


class LayerResidency:
    """One offloaded layer's resident set, tables and fetches (``row``: its index among offloaded layers)."""

    def __init__(self, row: int, host: HostStore, arena: ExpertArena, stats: ExpertStats, ops, router=None):
        self.row, self.host, self.arena, self.stats = row, host, arena, stats
        self.copy, self.fetch_list = ops.copy_expert_rows, ops.offload_fetch_list  # the op table's backends
        self.router = router  # this layer's router: what the layer before runs to fetch ahead for it
        self.num_experts = host.num_experts
        device = arena.device
        self.slot_of_expert = torch.full((self.num_experts,), -1, dtype=torch.int64, device=device)
        self.resident_mask = torch.zeros(self.num_experts, dtype=torch.bool, device=device)
        self.offloaded_ids = torch.zeros(arena.fetch_slots, dtype=torch.int64, device=device)
        self.fetch_entries = torch.tensor(list(arena.fetch_rows(row)), dtype=torch.int64, device=device)
        self.prefetched = torch.zeros(self.num_experts, dtype=torch.bool, device=device)  # fetched ahead
        self.marks = torch.zeros(self.num_experts, dtype=torch.int32, device=device)  # the fetch list op's scratch
        self.resident: list[int] = []
        self.slot_list: dict[int, int] = {}  # resident expert -> arena entry (the host's mirror)
        self.next_layer: LayerResidency | None = None  # fetched ahead by this layer (None: off or the last)
        self._in_flight: tuple | None = None  # what the copy stream reads until the next layer joins it

    # ---- a step (device side, fixed shapes) --------------------------------------------------------------
    def stage(self, x: torch.Tensor, expert_ids: torch.Tensor, input_ids: torch.Tensor | None = None):
        """Count this step's choices and make every chosen expert readable; the arena and the table to read by.

        ``x`` and ``input_ids`` (the layer's MoE input and the step's tokens) feed the next layer's fetch-ahead."""
        self._join_prefetch()  # the fetched-ahead mask and rows are the copy stream's until then
        self._copy_listed(expert_ids, self.stats.counting(self.row))
        if self.next_layer is not None and x.shape[0]:
            self.next_layer.prefetch(x, input_ids)
        return self.arena.weights, self.slot_of_expert

    def prefetch(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> None:
        """Copy the experts this layer's router picks for ``x`` (the layer before's MoE input) that are not
        resident, on the copy stream (CUDA); :meth:`stage` fetches whatever the prediction missed."""
        predicted, _ = self.router(x, input_ids)
        stream = self.arena.copy_stream
        if stream is None:
            self._fetch_ahead(predicted)
            return
        stream.wait_stream(torch.cuda.current_stream(x.device))  # the router's ids, and the buffer's last reader
        with torch.cuda.stream(stream):
            self._fetch_ahead(predicted)
        self._in_flight = (predicted,)  # kept alive until the compute stream has waited for the copy

    def _fetch_ahead(self, predicted: torch.Tensor) -> None:
        self._copy_listed(predicted, None)  # marks what it fetched; counts it as fetched, and fetched ahead

    def _join_prefetch(self) -> None:
        if self._in_flight is not None:
            torch.cuda.current_stream(self.arena.device).wait_stream(self.arena.copy_stream)
            self._in_flight = None

    def _copy_listed(self, expert_ids: torch.Tensor, counts: torch.Tensor | None) -> None:
        """The ``offload_fetch_list`` op's list for ``expert_ids`` (a stage's choices with ``counts``, else a fetch
        ahead's prediction), then one ``copy_expert_rows`` per part into the layer's fetch rows."""
        inputs = FetchListInputs(expert_ids, self.resident_mask, self.prefetched, self.offloaded_ids,
                                 self.host.row_of_expert, self.arena.counters, counts, self.marks,
                                 ahead=counts is None)  # fmt: skip
        self.arena.copy_rows(self.copy, self.host, self.fetch_list(inputs), self.fetch_entries)

    # ---- between steps (host side) -----------------------------------------------------------------------
    def rebalance(self, most_moves: int | None = None) -> int:
        """Make the layer's most-routed experts resident; how many experts moved in. ``most_moves``: move at most
        that many, the most-routed of the missing in for the least-routed of the unwanted (None: all)."""
        wanted = self.stats.resident(self.row, self.arena.resident)
        if most_moves is not None and self.stats.observed:
            ranked, kept = self.stats.ranked(self.row), set(wanted)
            entering = [e for e in ranked if e in kept and e not in self.slot_list][:most_moves]
            leaving = [e for e in reversed(ranked) if e in self.slot_list and e not in kept][: len(entering)]
            wanted = sorted((set(self.slot_list) - set(leaving)) | set(entering))
        return self.place(wanted)

    def place(self, wanted: list[int], filled: bool = False) -> int:
        """Make ``wanted`` the resident set (``filled``: their slots already hold them, in order, on a first
        placement); how many experts moved in. The tables change in place, so captured steps see them."""
        if len(wanted) != self.arena.resident:
            raise ValueError(f"{len(wanted)} resident experts for {self.arena.resident} slots")
        staying = set(wanted) & set(self.resident)
        leaving = [e for e in self.resident if e not in staying]
        entering = [e for e in wanted if e not in staying]
        freed = {e: self.slot_list.pop(e) for e in leaving}
        free = list(freed.values())
        free += list(self.arena.resident_rows(self.row))[len(self.resident) :]  # first fill: every slot is free
        targets = free[: len(entering)]
        if entering and not filled:
            self._move_in(entering, targets, freed)
        self.slot_list.update(zip(entering, targets, strict=True))
        self.resident = sorted(self.slot_list)
        self._publish()
        return 0 if filled else len(entering)

    def _move_in(self, entering: list[int], targets: list[int], freed: dict[int, int]) -> None:
        """Copy ``entering`` from the host into slots ``targets``; a store without the leaving experts (``freed``:
        each one's slot) first takes their device copies into the rows ``entering`` vacate (a swap through the
        fetch buffer, read before it is overwritten: the device -> host copy waits for the kernel)."""
        device, host = self.arena.device, self.host
        sources = [host.row_list[e] for e in entering]
        if any(row < 0 for row in sources):
            raise RuntimeError(f"layer {self.row}: the host store holds none of experts {entering}")
        swap = [e for e in freed if host.row_list[e] < 0]
        through = list(self.arena.fetch_rows(self.row))[: len(entering)] if swap else targets
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        self.arena.copy_rows(self.copy, host, as_tensor(sources), as_tensor(through))
        if swap:
            host.write_back(swap, sources[: len(swap)], self.arena.weights, [freed[e] for e in swap])
            for name in PARTS:
                part = getattr(self.arena.weights, name)
                if part is not None:
                    part.index_copy_(0, as_tensor(targets), part.index_select(0, as_tensor(through)))
            host.forget(entering[: len(swap)])

    def _publish(self) -> None:
        """Write the tables from the host mirror: resident slots, then each offloaded expert's fetch row."""
        table = [-1] * self.num_experts
        for expert, slot in self.slot_list.items():
            table[expert] = slot
        offloaded = [e for e in range(self.num_experts) if e not in self.slot_list]
        for expert, entry in zip(offloaded, self.arena.fetch_rows(self.row), strict=True):
            table[expert] = entry
        device = self.slot_of_expert.device
        self.slot_of_expert.copy_(torch.tensor(table, dtype=torch.int64).to(device))
        self.resident_mask.copy_(torch.tensor([e in self.slot_list for e in range(self.num_experts)]).to(device))
        self.offloaded_ids.copy_(torch.tensor(offloaded, dtype=torch.int64).to(device))
        self.host.publish()
