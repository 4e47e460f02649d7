"""``copy_expert_rows(source, target, source_rows, target_rows)``: routed experts copied from the host store into
the device's fetch slots, the rows to copy chosen on the device.

``source`` ``[R, W]`` and ``target`` ``[N, W]`` are one part of the experts (codes or scales) with each expert's
bytes as one row of ``W`` words; row ``i`` of the list goes from ``source[source_rows[i]]`` to
``target[target_rows[i]]``, and an entry whose ``source_rows`` is -1 copies nothing. The list has a fixed length
(one entry per offloaded expert of the layer) and its values are device tensors, so the step that calls it never
reads a device value on the host and can be captured in a CUDA graph.

Backends: ``reference`` (torch, the truth: a masked ``index_copy_``) and ``triton`` (CUDA: one program per entry
and chunk of the row reads the host store in place through its unified virtual address, so the copy is a kernel
a CUDA graph records like any other; see :mod:`dsinfer.ops.expert_fetch.triton`).
"""

from dsinfer.ops.expert_fetch import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.expert_fetch.reference import as_rows, copy_expert_rows_reference

__all__ = ["as_rows", "copy_expert_rows_reference"]
