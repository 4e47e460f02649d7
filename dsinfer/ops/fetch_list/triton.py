"""``offload_fetch_list`` as one Triton program: the fetch list and the offload's bookkeeping of a layer's step.

The program clears the layer's ``marks`` scratch, marks the chosen experts (and counts them, atomically, since
a step names an expert more than once), then with every expert's mark, residency and fetched-ahead bit in
registers computes the needed experts, updates the mask and the counters, writes the needed marks back and reads
them at the offloaded ids for the list. ``tl.debug_barrier`` between the phases makes one phase's stores to
``marks`` visible to the whole program before the next reads them. The counters take atomic adds: a fetch ahead
on the copy stream may update them while a stage on the compute stream does.
"""

from __future__ import annotations

import torch

from dsinfer.ops.fetch_list.reference import FetchListInputs, check_inputs
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

BLOCK_IDS = 1024  # router ids read a loop step
NUM_WARPS = 4

if triton is not None:

    @triton.jit
    def _fetch_list_kernel(ids_ptr, n_ids, resident_ptr, prefetched_ptr, offloaded_ptr, n_offloaded,
                           row_of_expert_ptr, counters_ptr, counts_ptr, marks_ptr, out_ptr, n_experts,
                           BLOCK_E: tl.constexpr, BLOCK_I: tl.constexpr, AHEAD: tl.constexpr):  # fmt: skip
        experts = tl.arange(0, BLOCK_E)
        in_e = experts < n_experts
        tl.store(marks_ptr + experts, tl.zeros([BLOCK_E], tl.int32), mask=in_e)
        tl.debug_barrier()
        for start in range(0, n_ids, BLOCK_I):
            index = start + tl.arange(0, BLOCK_I)
            ok = index < n_ids
            expert = tl.load(ids_ptr + index, mask=ok, other=0)
            tl.store(marks_ptr + expert, tl.full([BLOCK_I], 1, tl.int32), mask=ok)  # repeats store the same 1
            if not AHEAD:
                tl.atomic_add(counts_ptr + expert, tl.full([BLOCK_I], 1, tl.int64), mask=ok)
        tl.debug_barrier()
        chosen = tl.load(marks_ptr + experts, mask=in_e, other=0) != 0
        resident = tl.load(resident_ptr + experts, mask=in_e, other=0) != 0
        if AHEAD:
            need = chosen & ~resident
            tl.store(prefetched_ptr + experts, need.to(tl.int8), mask=in_e)
            fetched = tl.sum(need.to(tl.int64), axis=0)
            tl.atomic_add(counters_ptr + 2, fetched)
            tl.atomic_add(counters_ptr + 3, fetched)
        else:
            ahead = tl.load(prefetched_ptr + experts, mask=in_e, other=0) != 0
            need = chosen & ~resident & ~ahead
            tl.store(prefetched_ptr + experts, tl.zeros([BLOCK_E], tl.int8), mask=in_e)
            tl.atomic_add(counters_ptr + 0, tl.sum(chosen.to(tl.int64), axis=0))
            tl.atomic_add(counters_ptr + 1, tl.sum((chosen & resident).to(tl.int64), axis=0))
            tl.atomic_add(counters_ptr + 2, tl.sum(need.to(tl.int64), axis=0))
        tl.debug_barrier()  # every thread has read its marks before they are overwritten
        tl.store(marks_ptr + experts, need.to(tl.int32), mask=in_e)
        tl.debug_barrier()
        slots = tl.arange(0, BLOCK_E)
        in_f = slots < n_offloaded
        offloaded = tl.load(offloaded_ptr + slots, mask=in_f, other=0)
        wanted = tl.load(marks_ptr + offloaded, mask=in_f, other=0) != 0
        rows = tl.load(row_of_expert_ptr + offloaded, mask=in_f, other=-1)
        tl.store(out_ptr + slots, tl.where(wanted, rows, -1), mask=in_f)


def offload_fetch_list_launch(inputs: FetchListInputs) -> torch.Tensor:
    """The kernel, no fallback (also what the interpreter tests run)."""
    check_inputs(inputs)
    experts, offloaded = inputs.resident.shape[0], inputs.offloaded_ids.shape[0]
    out = torch.empty(offloaded, dtype=torch.int64, device=inputs.resident.device)
    ids = inputs.expert_ids.reshape(-1).contiguous()
    counts = inputs.counts if inputs.counts is not None else inputs.counters  # unused when ahead
    _fetch_list_kernel[(1,)](
        ids, ids.numel(), inputs.resident.view(torch.int8), inputs.prefetched.view(torch.int8),
        inputs.offloaded_ids.contiguous(), offloaded, inputs.row_of_expert, inputs.counters, counts, inputs.marks,
        out, experts, BLOCK_E=max(16, triton.next_power_of_2(max(experts, offloaded))), BLOCK_I=BLOCK_IDS,
        AHEAD=inputs.ahead, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


@register("offload_fetch_list", "triton", devices=("cuda",), available=triton_available)
def offload_fetch_list_triton(inputs: FetchListInputs) -> torch.Tensor:
    """Same contract as the reference, in one program."""
    if triton is None:
        raise RuntimeError("the triton offload_fetch_list backend needs Triton installed")
    return offload_fetch_list_launch(inputs)
