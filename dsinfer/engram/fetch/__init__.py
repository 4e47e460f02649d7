"""Fetch Engram rows for a step: three placements of the tables behind one interface, with prefetch.

:class:`EngramFetcher` turns row ids ``[T, k]`` (from :meth:`dsinfer.engram.hashing.EngramHasher.row_ids`)
into dequantised rows ``[T, k, 256]``. Every placement does the same three things:

1. **Plan** (:func:`plan_fetch`): sort the step's ids and drop duplicates (n-gram hashes of real text
   repeat a lot), keeping the inverse map. Sorting also orders the reads by address, which is what
   makes host reads fast (neighbouring rows share pages, so the GPU's and the IOMMU's translation
   caches hit). The plan needs no host synchronisation: the number of unique ids stays on the device.
2. **Gather** the unique rows and dequantise them (``code * 2**(scale - 127)``, exact):

   * ``device``: the tables sit in GPU memory (small models, or a big GPU budget).
   * ``host``: the tables stay in the host's shared-memory segment (:mod:`dsinfer.engram.store`).
     Three methods read them (:func:`resolve_host_method`): ``zero_copy`` registers the segment with
     ``cudaHostRegister`` and a Triton kernel (:mod:`dsinfer.kernels.engram_gather`) reads the rows
     straight over PCIe, dequantising on the fly; ``staged`` has CPU threads gather the rows into
     pinned buffers that reach the GPU as a few large copies (:mod:`dsinfer.engram.staged_gather`),
     then dequantises them there; ``split`` does both at once on two shares of each large fetch.
     Staging needs the ids on the host: one small device-to-host copy per layer.
   * ``sharded``: each rank holds rows ``[r * N / W, (r + 1) * N / W)`` of every table; a step sends
     each owner the ids it holds and gets the raw FP8 rows back through two ``all_to_all_single``
     calls (the upstream DeepInfer layout, over ``torch.distributed`` instead of RDMA reads).
3. **Expand** with the inverse map to ``[T, k, 256]``.

On CPU all three run the torch reference (:func:`dsinfer.kernels.engram_gather.gather_dequantize_reference`);
outputs are bit-identical across placements because the dequantisation is exact and ends in one
rounding to the output dtype.

**Prefetch.** :meth:`EngramFetcher.start` takes the ids of every Engram layer at the start of a step
and issues the gathers on a side CUDA stream, earliest layer first; :meth:`EngramFetcher.wait` makes
the compute stream wait for one layer's rows right before that layer. On CPU the same calls run
synchronously. The staged and split host methods plan on the side stream too (split also starts its
zero-copy share there), then hand each layer to a worker thread that waits for the ids to reach the
host and runs the CPU gather, the copies and the dequantisation; ``start`` returns at once and
``wait`` joins that layer's work (on CPU as well).

**What it costs** (measured on the H200 over PCIe 5 with ``benchmarks/engram_fetch.py``; the figures are in
docs/perf.md, history, 2026-11-29): scattered host reads are translation-bound (random rows of a large table
arrive at a fraction of the pinned copy's rate), sorting and de-duplication cut a long prefill's fetches several
times over, and prefetched behind the first layers with 32 programs the host placement adds well under 1% to a
65,536-token prefill step.
Small fetches (decode) skip the plan: below ``dedup_min_ids`` (65,536 ids on CUDA) its kernels
cost more than the duplicate rows they save.

**Modules.** :mod:`~dsinfer.engram.fetch.plan` (sort and de-duplicate), :mod:`~dsinfer.engram.fetch.base`
(the :class:`EngramFetcher` interface and its gather), one module per placement
(:mod:`~dsinfer.engram.fetch.device`, :mod:`~dsinfer.engram.fetch.host`, :mod:`~dsinfer.engram.fetch.sharded`),
:mod:`~dsinfer.engram.fetch.host_memory` (registered host memory as CUDA tensors) and
:mod:`~dsinfer.engram.fetch.factory` (choosing the placement, building its fetcher).
"""

from dsinfer.engram.fetch.base import EngramFetcher
from dsinfer.engram.fetch.device import DeviceEngramFetcher
from dsinfer.engram.fetch.factory import (
    DEVICE_BUDGET_ENV,
    PLACEMENT_ENV,
    PLACEMENTS,
    make_engram_fetcher,
    resolve_placement,
)
from dsinfer.engram.fetch.host import (
    DEFAULT_SPLIT_MIN_IDS,
    HOST_METHOD_ENV,
    HOST_METHODS,
    HostEngramFetcher,
    resolve_host_method,
)
from dsinfer.engram.fetch.host_memory import HostRegistration, host_tensor
from dsinfer.engram.fetch.plan import FetchPlan, plan_fetch
from dsinfer.engram.fetch.sharded import ShardedEngramFetcher, shard_bounds

__all__ = [
    "DEFAULT_SPLIT_MIN_IDS",
    "DEVICE_BUDGET_ENV",
    "HOST_METHODS",
    "HOST_METHOD_ENV",
    "PLACEMENTS",
    "PLACEMENT_ENV",
    "DeviceEngramFetcher",
    "EngramFetcher",
    "FetchPlan",
    "HostEngramFetcher",
    "HostRegistration",
    "ShardedEngramFetcher",
    "host_tensor",
    "make_engram_fetcher",
    "plan_fetch",
    "resolve_host_method",
    "resolve_placement",
    "shard_bounds",
]
