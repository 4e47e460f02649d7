"""``router_logits(x, weight, weight_parts)``: the MoE router's float32 logits (``bf16_parts`` splits the weight)."""

from dsinfer.ops.router_logits import split_mm  # noqa: F401  (registers the tensor-core backend)
from dsinfer.ops.router_logits.reference import bf16_parts, router_logits_reference

__all__ = ["bf16_parts", "router_logits_reference"]
