"""``offload_fetch_list(inputs)``: which offloaded experts a step must copy in, and the offload's bookkeeping.

An offloaded MoE layer (:class:`dsinfer.offload.residency.LayerResidency`) turns the router's top-k ids into the
list ``copy_expert_rows`` reads: the store row of each offloaded expert the step needs, -1 for the others. Around
that it keeps the layer's routing counts, the arena's traffic counters and the mask of experts fetched ahead. As
torch ops that is some twenty small kernels a layer and step, which at one request cost more time than the
arithmetic; the Triton backend does it in one program.

Two modes (``FetchListInputs.ahead``):

* **stage** (the layer itself, after joining its fetch-ahead): count the choices (``counts``), need = chosen, not
  resident, not fetched ahead; clear the fetched-ahead mask; add reads, reads served by resident experts and
  experts fetched to ``counters[0:3]``;
* **ahead** (the layer before, predicting this one's choices): need = predicted, not resident; the mask of experts
  fetched ahead becomes ``need``; add their number to ``counters[2]`` (fetched) and ``counters[3]`` (ahead).

Backends: ``reference`` (torch, the truth) and ``triton`` (CUDA: one program; a per-layer ``marks`` scratch of
``int32 [E]`` carries the chosen and the needed experts between its phases).
"""

from dsinfer.ops.fetch_list import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.fetch_list.reference import FetchListInputs, offload_fetch_list_reference

__all__ = ["FetchListInputs", "offload_fetch_list_reference"]
