"""DeepSeek-V4-Flash, top to bottom: embedding -> mHC blocks (attention, MoE) -> hc_head -> norm -> head.

Module and parameter names follow DeepSeek's official checkpoint naming (``embed``, ``layers.L.attn``,
``layers.L.ffn``, ``hc_head_fn``...), so a state dict of this module *is* an official checkpoint after
dequantisation. The forward takes a :class:`PackedBatch` of whole sequences.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.config import ConfigError, ModelConfig, SpeculativeConfig
from dsinfer.kv.batch import PackedBatch
from dsinfer.kv.cache_v4 import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.kv.codecs import index_key_fp8_format
from dsinfer.layers.mhc import hyper_head
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.op_binding import reference_ops
from dsinfer.layers.rotary import rope_inverse_frequencies
from dsinfer.models.block import Block
from dsinfer.models.mtp import MTPLayer
from dsinfer.models.served import CachePlan, ServedModel
from dsinfer.ops.registry import REFERENCE, OpTable, bind_ops, resolve


class RopeTables(nn.Module):
    """Inverse RoPE frequencies: plain for window-only layers, YaRN-scaled for compressed ones."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = config.qk_rope_head_dim
        self.register_buffer("window", rope_inverse_frequencies(dim, config.rope_theta, None), persistent=False)
        self.register_buffer(
            "compressed",
            rope_inverse_frequencies(dim, config.compress_rope_theta, config.yarn),
            persistent=False,
        )

    def for_ratio(self, compress_ratio: int) -> torch.Tensor:
        return self.compressed if compress_ratio else self.window


class DeepseekModel(ServedModel):
    """What both variants' top level shares: the embedding copied into ``hc_mult`` streams, the scratch cache of
    an engine-less batch, the op table, the output head, and the routed-experts rule for captured steps.
    Subclasses own ``embed``, ``head``, ``mtp`` and the rest of the :class:`ServedModel` contract."""

    def use_ops(self, ops: OpTable) -> None:
        """Give this model and every layer in it the op table ``ops``: the constructor binds the table it is
        given once (see :mod:`dsinfer.layers.op_binding`); a test binds another to compare backends."""
        bind_ops(self, ops)

    def join_projections(self) -> None:
        """Inference: projections of one input run as one GEMM (each module's ``join_projections``); the loaders
        call this once the weights are in place, training does not."""
        for module in self.modules():
            if module is not self and hasattr(module, "join_projections"):
                module.join_projections()

    def ensure_cache(self, batch: PackedBatch) -> None:
        """A batch without an engine cache gets a throw-away one (whole sequences from position 0)."""
        if batch.cache is None:
            batch.attach_scratch_cache(self.scratch_cache(batch.seq_lens, batch.input_ids.device, len(self.mtp) > 0))

    def copy_into_streams(self, embedded: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> the ``hc_mult`` residual streams [T, hc_mult, hidden], each a copy."""
        return embedded.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()

    def logits(self, hidden: torch.Tensor, logits_for: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits of every row of ``hidden``, or only of the rows ``logits_for``."""
        if logits_for is not None:
            hidden = hidden[logits_for]
        return self.head(hidden).float()

    def graph_capture_blocker(self, device: torch.device, step_rows: int) -> str | None:
        """A routed-experts backend that is the reference syncs with the host: no graph can hold it."""
        if resolve(device, self.embed.weight.dtype).chosen["routed_moe"].name == REFERENCE:
            return "the routed-experts backend is the reference, which syncs"
        return None


class DeepseekV4(DeepseekModel):
    def __init__(self, config: ModelConfig, with_mtp: bool = True, ops: OpTable | None = None) -> None:
        """``ops``: the op table resolved for the device and dtype the model will run on (the loaders pass
        ``resolve(device, dtype)``); None: every op's torch reference."""
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Block(config, i, config.compress_ratios[i], config.is_hash_layer(i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        n = config.hc_mult
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.rope = RopeTables(config)
        self.mtp = nn.ModuleList(
            MTPLayer(config, config.num_hidden_layers + i)
            for i in range(config.num_nextn_predict_layers if with_mtp else 0)
        )
        self.ops: OpTable = ops if ops is not None else reference_ops()  # the head's collapse
        self.use_ops(self.ops)  # every layer

    def hidden_streams(self, batch: PackedBatch) -> torch.Tensor:
        """Run the embedding and every block; returns the residual streams [T, hc_mult, hidden]."""
        self.ensure_cache(batch)
        batch.rope_angle_memo.clear()  # angles of an earlier forward may be of other positions
        streams = self.copy_into_streams(self.embed(batch.input_ids))
        for layer in self.layers:
            streams = layer(streams, batch, self.rope.for_ratio(layer.attn.compress_ratio), batch.input_ids)
        return streams

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        collapsed = hyper_head(
            streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps, self.ops
        )
        return self.norm(collapsed)

    def mtp_logits(self, streams: torch.Tensor, batch: PackedBatch, next_token_ids: torch.Tensor) -> torch.Tensor:
        """Draft logits [T, vocab] of the first MTP layer: position i, given token i + 1, guesses token i + 2.

        ``streams`` are the target's residual streams from :meth:`hidden_streams` for the same batch.
        """
        if not len(self.mtp):
            raise RuntimeError("this checkpoint has no MTP layer (no mtp.* tensors)")
        hidden = self.mtp[0].draft_hidden(streams, self.embed(next_token_ids), next_token_ids, batch, self.rope.window)
        return self.logits(hidden)

    def forward(self, batch: PackedBatch, logits_for: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] for every token, or only for the token indices in ``logits_for``.

        The head (stream collapse, norm, projection) works token by token, so where ``logits_for`` asks for fewer
        rows than the batch has (a prefill chunk's last token) only those rows reach it.
        """
        streams = self.hidden_streams(batch)
        if logits_for is not None and logits_for.shape[0] < streams.shape[0]:
            return self.logits(self.final_hidden(streams[logits_for]))
        return self.logits(self.final_hidden(streams), logits_for)

    # ---- the served-model contract -----------------------------------------------------------------------
    def cache_block_tokens(self, requested: int | None) -> int:
        """A multiple of every layer's compression ratio (entries never straddle blocks)."""
        return block_tokens_for(self.config, requested)

    def build_cache(self, plan: CachePlan) -> KVCache:
        """V4's cache; ``with_drafter`` adds the window rings of the MTP layers. ``kv_cache_dtype`` fp8 keeps the
        indexer's keys as the release does (e4m3 codes, a ue8m0 scale per 128 channels); auto and bf16 keep them in
        the model dtype (V4's other rows have one form)."""
        ratios = attention_layer_ratios(self.config, with_mtp=plan.with_drafter)
        dtype = self.embed.weight.dtype
        config = self.config
        index_keys = index_key_fp8_format(config.index_head_dim) if plan.kv_cache_dtype == "fp8" else None
        return KVCache(config, ratios, plan.num_slots, plan.num_blocks, plan.block_tokens, dtype, plan.device,
                       index_keys)  # fmt: skip

    def forward_for_drafter(
        self, batch: PackedBatch, logits_for: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of ``logits_for`` (as :meth:`forward` computes them) and the residual streams the MTP layer
        reads, [T, hc_mult, hidden]."""
        streams = self.hidden_streams(batch)
        return self.logits(self.final_hidden(streams), logits_for), streams

    def scratch_cache(self, seq_lens: list[int], device: torch.device | str, with_drafter: bool) -> KVCache:
        """A throw-away cache just big enough for whole sequences of ``seq_lens`` run from position 0."""
        return KVCache.scratch(self.config, seq_lens, self.embed.weight.dtype, device, with_drafter)

    def check_speculative_support(self, config: SpeculativeConfig) -> None:
        """V4 drafts with its MTP layers (``method: mtp``) only."""
        if config.method == "dspark":
            raise ConfigError(
                "speculative_config 'method': 'dspark' drafts with DeepSeek-V4.1's DSpark stages; this is a V4 "
                "checkpoint (use 'mtp')"
            )
        if not len(self.mtp):
            raise ConfigError(
                "speculative_config 'method': 'mtp' needs the checkpoint's MTP layers, and this one has none "
                "(no mtp.* tensors)"
            )
