"""Mixture of experts: sqrt-softplus router, hash-routed first layers, clamped SwiGLU experts, shared expert."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.config import ModelConfig, ModelConfigBase
from dsinfer.layers.fp8_linear import Fp8Stack
from dsinfer.layers.joined_linear import join_linears
from dsinfer.layers.op_binding import reference_ops
from dsinfer.ops.moe import ExpertWeights, stack_experts
from dsinfer.ops.registry import OpTable
from dsinfer.ops.router import MoeRouteInputs
from dsinfer.ops.router_logits import bf16_parts
from dsinfer.ops.side_stream import beside


class Expert(nn.Module):
    """SwiGLU feed-forward with DeepSeek's clamps: gate <= limit, up in [-limit, limit]."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float) -> None:
        super().__init__()
        self.limit = swiglu_limit
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)  # gate
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)  # down
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)  # up
        self.ops: OpTable = reference_ops()  # the model binds its table when it is built
        # inference: w1 and w3 stacked (join_projections), a weight or FP8 codes and scales kept as stored
        self.joined_gate_up: torch.Tensor | Fp8Stack | None = None

    def join_projections(self) -> None:
        """Gate and up in one GEMM, activated by the ``clamped_swiglu`` op (inference; see ``join_linears``)."""
        if isinstance(self.joined_gate_up, Fp8Stack) and self.joined_gate_up.holds(self.w1, self.w3):
            return
        joined = join_linears(self.w1, self.w3)
        self.joined_gate_up = joined if joined is not None else Fp8Stack.join(self.w1, self.w3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.joined_gate_up is not None:
            swiglu = self.ops.clamped_swiglu
            joined = self.joined_gate_up
            gate_up = joined(x) if isinstance(joined, Fp8Stack) else F.linear(x, joined)
            return self.w2(swiglu(gate_up, self.limit))
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Router(nn.Module):
    """Scores every expert with sqrt(softplus(x W^T / gate_temp)); picks the top-k (or the token's fixed experts).

    The learned bias only steers *which* experts are picked; the mixing weights come from the unbiased
    scores, normalised over the picked experts and multiplied by ``routed_scaling_factor``. V4's hash layers
    replace the pick by the frozen table ``tid2eid[token]``; V4.1 divides the logits by ``gate_temp`` and selects
    image tokens with a second bias ``bias_vl`` (``image_bias``), and normalises only when it picks more than one.
    """

    def __init__(
        self,
        config: ModelConfigBase,
        hash_routed: bool,
        n_experts: int | None = None,
        top_k: int | None = None,
        *,
        image_bias: bool = False,
        normalize_single_pick: bool = True,
    ) -> None:
        super().__init__()
        n_experts = config.n_routed_experts if n_experts is None else n_experts
        self.top_k = config.num_experts_per_tok if top_k is None else top_k
        self.gate_temp = getattr(config, "gate_temp", 1.0)
        self.scaling = config.routed_scaling_factor
        self.normalize = config.norm_topk_prob and (normalize_single_pick or self.top_k > 1)
        self.hash_routed = hash_routed
        self.weight = nn.Parameter(torch.zeros(n_experts, config.hidden_size))
        if hash_routed:
            self.register_buffer(
                "tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.int32), persistent=True
            )
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32)) if image_bias else None
        self.ops: OpTable = reference_ops()  # the model binds its table when it is built
        self.weight_parts: torch.Tensor | None = None  # inference: the weight as exact bf16 parts (join_projections)

    def join_projections(self) -> None:
        """Split the weight into exact bf16 parts once, for the ``router_logits`` op's tensor-core backend."""
        if self.weight.dtype in (torch.float32, torch.bfloat16):
            self.weight_parts = bf16_parts(self.weight.detach())

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor | None = None, image_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [T, k] and mixing weights [T, k] (float32); ``image_mask`` [T] picks ``bias_vl``."""
        router_logits = self.ops.router_logits
        logits = router_logits(x, self.weight, self.weight_parts)
        route = self.ops.moe_route
        if self.hash_routed:
            bias, bias_vl, table, token_ids = None, None, self.tid2eid, input_ids
        else:  # image tokens pick with bias_vl: per token on the device, no host read
            bias, bias_vl, table, token_ids = self.bias, self.bias_vl, None, None
        pick = (self.top_k, self.normalize, self.scaling)
        return route(MoeRouteInputs(logits, self.gate_temp, bias, bias_vl, image_mask, table, token_ids, *pick))


class MoE(nn.Module):
    """Router, routed experts and the shared expert of one layer.

    The routed experts come in one of two forms. A model built in memory (random weights, training) holds them
    as ``experts``, one :class:`Expert` each under the official names. A loaded model holds them stacked in
    checkpoint precision (:class:`~dsinfer.ops.moe.ExpertWeights`: packed FP4 codes and ue8m0 scales, or dense
    floats when the checkpoint stores floats) as the buffers ``routed_w13``, ``routed_w13_scale``,
    ``routed_w2`` and ``routed_w2_scale``; :meth:`pack` turns the one into the other. Either way the routed part
    runs through the ``routed_moe`` op, whose backend was chosen once for the model's device and dtype.
    """

    def __init__(self, config: ModelConfig, hash_routed: bool) -> None:
        super().__init__()
        self.gate = Router(config, hash_routed)
        self._build_experts(config, config.n_routed_experts)

    def _build_experts(self, config: ModelConfigBase, n_experts: int) -> None:
        self.n_experts = n_experts
        self.swiglu_limit = config.swiglu_limit
        self.ops: OpTable = reference_ops()  # the model binds its table when it is built
        self.experts: nn.ModuleList | None = nn.ModuleList(
            Expert(config.hidden_size, config.moe_intermediate_size, config.swiglu_limit) for _ in range(n_experts)
        )
        self.shared_experts = (
            Expert(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit)
            if config.n_shared_experts
            else None
        )
        self._routed_form: tuple[int, bool] | None = None  # (intermediate size, is_fp4) once packed
        # Expert parallelism (dsinfer.parallel.ep.ExpertParallel): the routed part goes through its dispatch
        # and combine, and this layer holds only the rank's experts. None: every expert is here.
        self.expert_parallel = None
        # Experts offloaded to host memory (dsinfer.offload.LayerResidency): the slot of each expert. None: resident.
        self.expert_residency = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self._with_shared(x, lambda: self._dispatch(x, *self.gate(x, input_ids), input_ids=input_ids))

    # ---- the routed experts' two forms --------------------------------------------------------------
    def pack(self, weights: ExpertWeights, num_local: int | None = None) -> None:
        """Serve the routed experts from stacked checkpoint-precision weights; the per-expert modules go.

        ``num_local``: an EP rank stacks only its own experts (``dsinfer.parallel.ep``)."""
        expected = self.n_experts if num_local is None else num_local
        if weights.num_experts != expected:
            raise ValueError(f"{weights.num_experts} stacked experts for a layer of {expected}")
        self.experts = None
        self.register_buffer("routed_w13", weights.w13)
        self.register_buffer("routed_w13_scale", weights.w13_scale)
        self.register_buffer("routed_w2", weights.w2)
        self.register_buffer("routed_w2_scale", weights.w2_scale)
        self._routed_form = (weights.intermediate_size, weights.is_fp4)

    @property
    def is_packed(self) -> bool:
        return self._routed_form is not None

    def routed_weights(self) -> ExpertWeights:
        """The routed experts in the op's layout (stacked from the modules when the model was built in memory)."""
        if self._routed_form is not None:
            intermediate, fp4 = self._routed_form
            return ExpertWeights(
                self.routed_w13, self.routed_w13_scale, self.routed_w2, self.routed_w2_scale, intermediate, fp4
            )
        experts = self.experts
        return stack_experts(
            [e.w1.weight for e in experts], [e.w3.weight for e in experts], [e.w2.weight for e in experts]
        )

    def _with_shared(self, x: torch.Tensor, routed: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``routed()`` (the router and routed experts) plus the shared expert of ``x``. The shared expert reads
        nothing the routed part writes: at decode on CUDA it runs on the side stream beside the router and the
        routed experts (:func:`~dsinfer.ops.side_stream.beside`). Not under expert parallelism, whose routed part
        exchanges tokens between ranks."""
        if self.shared_experts is None:
            return routed()
        if self.expert_parallel is not None:
            return routed() + self.shared_experts(x)
        shared, out = beside(lambda: self.shared_experts(x), routed, x)
        return out + shared

    def _dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, input_ids=None) -> torch.Tensor:
        """Run each picked expert on its tokens and mix by ``weights`` (the routed part; the caller adds the
        shared expert)."""
        if self.expert_parallel is not None:
            return self.expert_parallel(self, x, experts, weights)
        return self.run_routed(x, experts, weights, input_ids)

    def run_routed(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, input_ids=None) -> torch.Tensor:
        """The ``routed_moe`` op over this layer's (or this EP rank's) experts; offloaded experts are staged first
        (:meth:`dsinfer.offload.residency.LayerResidency.stage`) and read through the slot table."""
        if self.expert_residency is not None:
            arena, slots = self.expert_residency.stage(x, experts, input_ids)
            return self.ops.routed_moe(x, arena, experts, weights, self.swiglu_limit, slot_of_expert=slots)
        return self.ops.routed_moe(x, self.routed_weights(), experts, weights, self.swiglu_limit)


class MoEV41(MoE):
    """V4.1 MoE (backbone: 384 experts top-6; DSpark stages: their own expert count and top-k): every layer
    scored, image tokens selected with ``bias_vl``; the same router, experts and dispatch as V4."""

    def __init__(self, config, n_experts: int, top_k: int) -> None:
        nn.Module.__init__(self)
        self.gate = Router(config, False, n_experts, top_k, image_bias=True, normalize_single_pick=False)
        self._build_experts(config, n_experts)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._with_shared(x, lambda: self._dispatch(x, *self.gate(x, image_mask=image_mask)))
