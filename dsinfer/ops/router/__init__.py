"""``moe_route(scores, bias, fixed_experts, k, normalize, scaling)``: the MoE router's expert pick and weights."""

from dsinfer.ops.router import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.router.reference import moe_route_reference

__all__ = ["moe_route_reference"]
