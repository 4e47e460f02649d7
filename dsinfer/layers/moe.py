"""Mixture of experts: sqrt-softplus router, hash-routed first layers, clamped SwiGLU experts, shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.config import ModelConfig


class Expert(nn.Module):
    """SwiGLU feed-forward with DeepSeek's clamps: gate <= limit, up in [-limit, limit]."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float) -> None:
        super().__init__()
        self.limit = swiglu_limit
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)  # gate
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)  # down
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Router(nn.Module):
    """Scores every expert with sqrt(softplus(x W^T)); picks the top-k (or the token's fixed experts).

    The learned bias only steers *which* experts are picked; the mixing weights come from the unbiased
    scores, normalised over the picked experts and multiplied by ``routed_scaling_factor``.
    Hash layers replace the pick by the frozen table ``tid2eid[token]``.
    """

    def __init__(self, config: ModelConfig, hash_routed: bool) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.scaling = config.routed_scaling_factor
        self.normalize = config.norm_topk_prob
        self.hash_routed = hash_routed
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hash_routed:
            self.register_buffer(
                "tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.int32), persistent=True
            )
        else:
            self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [T, k] and mixing weights [T, k] (float32)."""
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()
        if self.hash_routed:
            experts = self.tid2eid[input_ids].long()
        else:
            experts = torch.topk(scores + self.bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, hash_routed: bool) -> None:
        super().__init__()
        self.n_experts = config.n_routed_experts
        self.gate = Router(config, hash_routed)
        self.experts = nn.ModuleList(
            Expert(config.hidden_size, config.moe_intermediate_size, config.swiglu_limit)
            for _ in range(config.n_routed_experts)
        )
        self.shared_experts = (
            Expert(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                config.swiglu_limit,
            )
            if config.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(x, input_ids)
        routed = torch.zeros_like(x)
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=self.n_experts).tolist()
        token_of_slot = order // experts.shape[1]
        start = 0
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            tokens = token_of_slot[start : start + count]
            start += count
            out = self.experts[expert_id](x[tokens]) * weights.flatten()[slots, None].to(x.dtype)
            routed.index_add_(0, tokens, out)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed
