"""DeepSeek-V4.1's DSpark draft stages (``mtp.0`` .. ``mtp.N-1``): block drafting for speculative decoding.

The target model hands over, for every position it has run, the mean of the residual streams entering
each of ``dspark_target_layer_ids`` (37, 38, 39 in the release), concatenated. Stage 0's ``main_proj`` and
``main_norm`` turn that into one vector per position, and every stage keeps a ``sliding_window``-slot ring
of keys ``fp8(rope(kv_norm(wkv(main))))`` at those positions (:func:`seed_rings`).

A draft (:func:`draft_block`) takes the block ``[token, noise x (block_size - 1)]`` at the positions after
the target's last one, runs it through the stages (each: window attention over its whole ring plus the
block itself, non-causal within the block; a ``dspark_n_routed_experts`` top-``dspark_num_experts_per_tok``
MoE; staggered mHC as in the backbone), collapses with the last mix, and reads logits through the last
stage's norm and the target's head. A rank-``dspark_markov_rank`` Markov head adds a bias that depends on
the previously drafted token (so drafting is sequential over the block), and a confidence head scores each
drafted position from ``[pre-norm hidden, Markov embedding]``. Deciding how many drafts to verify is the
speculative decoder's job (``dsinfer.speculative.dspark``); here the stages are run, batched over sequences
(:func:`draft_blocks`, one ring per block).

Follows the MLX port ``thedracle/deepseek-v41-mlx`` (``dspark.py``), which checks itself against
DeepSeek's ``forward_spec``; Hugging Face does not model these layers yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.config import ModelConfigV41
from dsinfer.layers.attention import Attention, sink_softmax
from dsinfer.layers.mhc import collapse_streams
from dsinfer.layers.moe import MoEV41
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import RoundingPoint, apply_rope, rope_and_round
from dsinfer.models.block import HyperConnectedBlock
from dsinfer.ops.fake_quant import ActivationQuantizer

if TYPE_CHECKING:
    from dsinfer.models.deepseek_v41 import DeepseekV41


@dataclass
class DraftBlock:
    logits: torch.Tensor  # [block_size, vocab] float32, Markov bias included
    tokens: list[int]  # the greedy drafted tokens, one per block position
    confidence: torch.Tensor  # [block_size] float32 confidence-head logits


class DSparkAttention(Attention):
    """Window attention of a draft stage: keys are its ring (target positions) plus the draft block."""

    def __init__(self, config: ModelConfigV41, stage: int) -> None:
        super().__init__(config, compress_ratio=0)  # window only: V4's projections, norms and sinks
        self.stage = stage

    def keys(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        quantizer: ActivationQuantizer,
        angles: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The stage's window keys of ``x`` at ``positions`` (``angles``: their cos and sin, when the caller has
        them)."""
        cos, sin = angles if angles is not None else self.ops.rope_angles(positions, inv_freq)
        return rope_and_round(
            self.wkv(x),
            cos,
            sin,
            self.ops,
            self.kv_norm,
            RoundingPoint(quantizer, "window_kv", f"mtp.{self.stage}", positions),
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ring_keys: torch.Tensor,
        inv_freq: torch.Tensor,
        quantizer: ActivationQuantizer,
        ring_visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, hidden] at ``positions`` [B]; every query sees every ring key and every block key.

        Several blocks at once (training): ``ring_keys`` [A, K, D] holds each block's own ring and x the A
        blocks' rows one block after the other; ``ring_visible`` [A, K] marks the ring slots each block has."""
        cos, sin = self.ops.rope_angles(positions, inv_freq)
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(-1, self.n_heads, self.head_dim)
        q = apply_rope(q, cos, sin, ops=self.ops)
        block_keys = self.keys(x, positions, inv_freq, quantizer, (cos, sin))
        if ring_keys.dim() == 2:
            out = self._attend_keys(q, torch.cat([ring_keys.to(x.dtype), block_keys]), None)
        else:
            out = self._attend_blocks(q, ring_keys.to(x.dtype), block_keys, ring_visible)
        return self._project_out(apply_rope(out, cos, sin, inverse=True, ops=self.ops))

    def _attend_blocks(
        self, q: torch.Tensor, ring_keys: torch.Tensor, block_keys: torch.Tensor, ring_visible: torch.Tensor | None
    ) -> torch.Tensor:
        """Queries [A * B, H, D] of A blocks, each over its ring [K, D] (visible slots only) and its own block."""
        blocks = ring_keys.shape[0]
        size = q.shape[0] // blocks
        keys = torch.cat([ring_keys, block_keys.view(blocks, size, -1)], dim=1)
        visible = torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device)
        if ring_visible is not None:
            visible[:, : ring_keys.shape[1]] = ring_visible
        logits = torch.einsum("ashd,akd->ahsk", q.view(blocks, size, *q.shape[1:]), keys).float()
        probs = sink_softmax(logits * self.softmax_scale, self.attn_sink, ~visible[:, None, None, :])
        return torch.einsum("ahsk,akd->ashd", probs.to(keys.dtype), keys).flatten(0, 1)


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=False)


class DSparkStage(HyperConnectedBlock):
    """One draft stage; stage 0 owns the target-hidden projection, the last stage the output heads."""

    def __init__(self, config: ModelConfigV41, stage: int, num_stages: int) -> None:
        super().__init__()
        dim = config.hidden_size
        attn = DSparkAttention(config, stage)  # built before the MoE: random initialisation keeps its order
        self._build_sites(
            config, attn, MoEV41(config, config.dspark_n_routed_experts, config.dspark_num_experts_per_tok)
        )
        if stage == 0:
            self.main_proj = nn.Linear(dim * len(config.dspark_target_layer_ids), dim, bias=False)
            self.main_norm = RMSNorm(dim, config.rms_norm_eps)
        if stage == num_stages - 1:
            self.norm = RMSNorm(dim, config.rms_norm_eps)
            self.markov_head = MarkovHead(config.vocab_size, config.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(dim + config.dspark_markov_rank)

    def forward(
        self,
        streams: torch.Tensor,
        pre_mix: torch.Tensor,
        positions: torch.Tensor,
        ring_keys: torch.Tensor,
        inv_freq: torch.Tensor,
        quantizer: ActivationQuantizer,
        ring_visible: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sites, staggered as the target's layers are: streams and the mix the next stage collapses with."""
        streams, attn_pre = self.run_site(
            streams, "attn", pre_mix, lambda x: self.attn(x, positions, ring_keys, inv_freq, quantizer, ring_visible)
        )
        return self.run_site(streams, "ffn", attn_pre, self.ffn)


def seed_ring_rows(
    stages: nn.ModuleList,
    rings: list[torch.Tensor],
    slots: torch.Tensor | int,
    target_hidden: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    quantizer: ActivationQuantizer,
) -> None:
    """Write ring rows ``position % window`` of ``slots`` (one per row, or one for all) from target hiddens
    [n, targets * hidden]; no two rows may land on the same (slot, ring row)."""
    if not rings or not target_hidden.shape[0]:
        return
    window = rings[0].shape[1]
    main = stages[0].main_norm(stages[0].main_proj(target_hidden))
    for stage, ring in zip(stages, rings, strict=True):
        keys = stage.attn.keys(main, positions, inv_freq, quantizer)
        ring[slots, positions % window] = keys.to(ring.dtype)


def seed_rings(
    stages: nn.ModuleList,
    rings: list[torch.Tensor],
    slot: int,
    target_hidden: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    quantizer: ActivationQuantizer,
) -> None:
    """Write each stage's ring slots ``position % window`` of one slot from its target hiddens [n, targets * hidden]
    (consecutive positions; only the last ``window`` can still be seen)."""
    window = rings[0].shape[1] if rings else 0
    recent = slice(max(0, target_hidden.shape[0] - window), None)
    seed_ring_rows(stages, rings, slot, target_hidden[recent], positions[recent], inv_freq, quantizer)


@dataclass
class DraftBlocks:
    """Greedy drafts of B sequences, the first ``columns`` positions of each block."""

    logits: torch.Tensor  # [B, columns, vocab] float32, Markov bias included
    tokens: torch.Tensor  # [B, columns] int64, each column's argmax
    confidence: torch.Tensor  # [B, columns] float32 confidence-head logits: is every draft up to here right?


@torch.no_grad()
def draft_blocks(
    model: DeepseekV41,
    rings: list[torch.Tensor],
    slots: torch.Tensor,
    last_positions: torch.Tensor,
    tokens: torch.Tensor,
    columns: int | None = None,
) -> DraftBlocks:
    """Block drafts of B sequences at once: ``tokens`` [B] sit at ``last_positions + 1`` [B], the rings of
    ``slots`` [B] hold the target positions up to ``last_positions``.

    Every block runs whole (``dspark_block_size`` positions, attention non-causal within it, as trained); the
    Markov bias then makes the drafts sequential over the first ``columns`` positions (greedy: each column's
    argmax feeds the next column's bias). No value is read on the host."""
    cfg = model.config
    size, window = cfg.dspark_block_size, cfg.sliding_window
    columns = size if columns is None else columns
    if not 1 <= columns <= size:
        raise ValueError(f"columns: expected 1 to the block size {size}, got {columns}")
    count, device = tokens.shape[0], tokens.device
    ids = torch.full((count, size), cfg.dspark_noise_token_id, dtype=torch.long, device=device)
    ids[:, 0] = tokens
    positions = (last_positions + 1)[:, None] + torch.arange(size, device=device)
    visible = torch.arange(window, device=device)[None, :] <= last_positions[:, None]  # slots holding a position
    streams, pre_mix = model.embed_streams(ids.flatten())
    for stage, ring in zip(model.mtp, rings, strict=True):
        streams, pre_mix = stage(streams, pre_mix, positions.flatten(), ring[slots], model.rope.window,
                                 model.quantizer, ring_visible=visible)  # fmt: skip
    last = model.mtp[-1]
    hidden = collapse_streams(streams, pre_mix, last.ops).view(count, size, -1)[:, :columns]
    logits = model.head(last.norm(hidden)).float()
    previous = tokens
    biased, drafted, embeddings = [], [], []
    for column in range(columns):
        embedding = last.markov_head.embed(previous)
        scores = logits[:, column] + last.markov_head.head(embedding).float()
        previous = scores.argmax(dim=-1)
        biased.append(scores)
        drafted.append(previous)
        embeddings.append(embedding)
    features = torch.cat([hidden.float(), torch.stack(embeddings, dim=1).float()], dim=-1)
    confidence = F.linear(features, last.confidence_head.proj.weight.float())[..., 0]
    return DraftBlocks(torch.stack(biased, dim=1), torch.stack(drafted, dim=1), confidence)


def draft_block(model: DeepseekV41, rings: list[torch.Tensor], slot: int, last_position: int, token: int) -> DraftBlock:
    """Greedy block draft after ``token`` (which sits at ``last_position + 1``), Markov bias and confidence."""
    device = model.embed.weight.device

    def one(value: int) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.long, device=device)

    block = draft_blocks(model, rings, one(slot), one(last_position), one(token))
    return DraftBlock(block.logits[0], block.tokens[0].tolist(), block.confidence[0])
