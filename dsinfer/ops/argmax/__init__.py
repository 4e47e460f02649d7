"""``greedy_argmax(scores)``: each row's greedy token, the first maximum (a row holding NaN: its first NaN)."""

from dsinfer.ops.argmax import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.argmax.reference import greedy_argmax_reference

__all__ = ["greedy_argmax_reference"]
