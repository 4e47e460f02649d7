"""``clamped_swiglu(gate_up, limit)``: DeepSeek's clamped SwiGLU on a joined gate-and-up projection."""

from dsinfer.ops.swiglu import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.swiglu.reference import clamped_swiglu_reference

__all__ = ["clamped_swiglu_reference"]
