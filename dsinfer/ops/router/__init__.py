"""``moe_route(MoeRouteInputs(logits, gate_temp, bias, bias_vl, image_mask, hash_table, token_ids, k, normalize,
scaling))``: the MoE router's scores, expert pick and weights from its logits."""

from dsinfer.ops.router import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.router.reference import MoeRouteInputs, moe_route_reference, route_scores

__all__ = ["MoeRouteInputs", "moe_route_reference", "route_scores"]
