"""``engram_gate(streams, key, value, weight, gate_mask, eps)``: the Engram layer's gated write into the streams.

Backends: ``reference`` (torch, the layer's former inline math) and ``triton`` (CUDA: one program per token and
stream, the three sums over the hidden axis in registers, then the write).
"""

from dsinfer.ops.engram_gate import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.engram_gate.reference import GATE_MAGNITUDE_FLOOR, EngramGateInputs, engram_gate_reference

__all__ = ["GATE_MAGNITUDE_FLOOR", "EngramGateInputs", "engram_gate_reference"]
