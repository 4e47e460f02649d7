"""DeepSeek-V4.1-Flash, top to bottom: embedding -> [Engram] -> staggered-mHC blocks (CSA2 attention, MoE)
-> collapse with the last site's mix -> norm -> head.  Only what differs from V4 lives here.

* **Staggered mHC**: each site computes (pre, post, comb) from its input streams, but a site's ``pre`` is
  used by the *next* site: attention collapses with the previous layer's FFN ``pre`` (a one-hot on stream 0
  at layer 0), the FFN with its own layer's attention ``pre``, and the final collapse with the last FFN's
  ``pre``. There is no ``hc_head``.
* **CSA2 attention** (``dsinfer.layers.csa2``): compressed KV computed by a few source layers and reused.
* **Engram** (``dsinfer.engram``): gated n-gram memory added to the streams before its layers' blocks. Each
  forward computes every Engram layer's row ids once, starts their fetch (:class:`EngramReads`), and each
  layer collects its dequantised rows right before it runs, from wherever the tables live: the layers' own
  buffers, or a host / sharded fetcher attached at load time (:meth:`DeepseekV41.attach_engram_fetcher`).
* **MoE**: every layer scored (no hash routing); image tokens select with ``bias_vl``.
* **Trained-in fake quantization** of window KV, compressed KV and indexer q/k: on by default
  (:meth:`DeepseekV41.set_fake_quantization` turns it off, for tests).
* **CED prefill** (:meth:`DeepseekV41.prefill`): ``exact`` runs every layer over the prompt; ``bounded``
  runs the encoder over the prompt, lets the first decoder layer (a ratio-1 KV source) turn the encoder
  output into the decoder's global KV, and re-runs the decoder only over the last ``replay_tokens``.
* **DSpark** stages (``dsinfer.models.dspark``) under ``mtp.N``: loaded and runnable as modules.

Module and parameter names follow the official checkpoint (``layers.L.attn.indexer.wk``,
``layers.L.engram.embed.weight``, ``layers.L.ffn.gate.bias_vl``, ``mtp.N.markov_head.embed.weight`` ...).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from dsinfer.config import ConfigError, EngineConfig, ModelConfigV41, SpeculativeConfig
from dsinfer.engram.hashing import ENGRAM_DEAD, EngramHasher
from dsinfer.engram.module import Engram, EngramTableFetcher
from dsinfer.engram.placement import EngramRowSource
from dsinfer.kv.batch import PackedBatch
from dsinfer.kv.cache_v41 import KVCacheV41, block_tokens_for_v41
from dsinfer.layers.csa2 import AttentionV41
from dsinfer.layers.csa2_state import PublishedState
from dsinfer.layers.mhc import collapse_streams
from dsinfer.layers.moe import MoEV41
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.op_binding import reference_ops
from dsinfer.models.block import HyperConnectedBlock
from dsinfer.models.ced import skips_decoder, split_at_decoder
from dsinfer.models.deepseek_v4 import DeepseekModel, RopeTables
from dsinfer.models.dspark import DraftBlock, DSparkStage, draft_block, seed_rings
from dsinfer.models.served import CachePlan
from dsinfer.models.vision import add_image_encoder, encode_images
from dsinfer.ops.fake_quant import ActivationQuantizer
from dsinfer.ops.registry import OpTable

logger = logging.getLogger(__name__)

PREFILL_MODES = ("exact", "bounded")
DEFAULT_REPLAY_TOKENS = 140  # DeepInfer's choice: the 128-token window plus look-back


class EngramReads:
    """One forward's Engram rows: every layer's fetch issued at the start, each collected right before its layer.

    A layer's rows are handed out once and then dropped, unless the caller keeps them: CED prefill runs its
    first decoder layer twice (the compressor pass over the whole prompt, then the replay).
    """

    def __init__(self, source: EngramRowSource, row_ids_per_layer: dict[int, torch.Tensor]) -> None:
        self.source = source
        self._rows: dict[int, torch.Tensor] = {}
        source.start(row_ids_per_layer)

    def take(self, layer_id: int, keep: bool = False) -> torch.Tensor:
        """Layer ``layer_id``'s dequantised rows [T, columns, dim] for every token of the forward."""
        rows = self._rows.pop(layer_id, None)
        if rows is None:
            rows = self.source.wait(layer_id)
        if keep:
            self._rows[layer_id] = rows
        return rows


@dataclass
class ForwardContext:
    """What every block of one forward needs besides its streams."""

    batch: PackedBatch
    rope: RopeTables
    quantizer: ActivationQuantizer
    published: PublishedState  # what KV / index sources publish to later layers
    engram_rows: torch.Tensor | None = None  # [T, engram layers, columns] row ids
    engram_reads: EngramReads | None = None  # the forward's fetched rows, shared by sliced contexts
    engram_tokens: torch.Tensor | None = None  # which tokens of the forward this context holds; None: all
    gate_mask: torch.Tensor | None = None  # [T] False at image tokens (Engram gate shut)
    image_mask: torch.Tensor | None = None  # [T] True at image tokens (MoE selects with bias_vl)
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # DSpark targets: layer -> [T, hidden]

    def sliced(self, batch: PackedBatch, rows: torch.Tensor) -> ForwardContext:
        """The context of a sub-batch made of the token indices ``rows`` (CED replay)."""

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return replace(
            self,
            batch=batch,
            published=PublishedState.per_sequence(batch),
            engram_rows=take(self.engram_rows),
            engram_tokens=rows if self.engram_tokens is None else self.engram_tokens[rows],
            gate_mask=take(self.gate_mask),
            image_mask=take(self.image_mask),
            captured={},
        )

    def engram_values(self, layer_id: int, keep: bool = False) -> torch.Tensor:
        """Dequantised rows [T, columns, dim] of Engram layer ``layer_id`` for this context's tokens."""
        rows = self.engram_reads.take(layer_id, keep)
        return rows if self.engram_tokens is None else rows[self.engram_tokens]


class BlockV41(HyperConnectedBlock):
    """One V4.1 layer: optional Engram, then an attention site and an MoE site with staggered mHC."""

    def __init__(self, config: ModelConfigV41, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.engram = Engram(config, layer_id) if layer_id in config.engram_layer_ids else None
        attn = AttentionV41(config, layer_id)  # built before the MoE: random initialisation keeps its order
        self._build_sites(config, attn, MoEV41(config, config.n_routed_experts, config.num_experts_per_tok))

    def with_engram(self, streams: torch.Tensor, ctx: ForwardContext, keep_rows: bool = False) -> torch.Tensor:
        """The streams after this layer's Engram (if it has one); ``keep_rows`` when the layer runs again."""
        if self.engram is None:
            return streams
        return self.engram(streams, ctx.engram_values(self.layer_id, keep_rows), ctx.gate_mask)

    def forward(
        self, streams: torch.Tensor, pre_mix: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams [T, hc, hidden] and the mix the next site collapses with, [T, hc]."""
        streams = self.with_engram(streams, ctx)
        if self.layer_id in ctx.captured:
            ctx.captured[self.layer_id] = streams.float().mean(dim=-2).to(streams.dtype)
        inv_freq = ctx.rope.for_ratio(self.attn.compress_ratio)
        # Staggered mHC: the attention site collapses with the previous site's ``pre``, the MoE site with its own
        # layer's attention ``pre``, and the MoE site's ``pre`` goes on to the next layer.
        attention = self.attn
        streams, attn_pre = self.run_site(
            streams, "attn", pre_mix, lambda x: attention(x, ctx.batch, inv_freq, ctx.published, ctx.quantizer)
        )
        return self.run_site(streams, "ffn", attn_pre, lambda x: self.ffn(x, ctx.image_mask))

    def compress_only(self, streams: torch.Tensor, pre_mix: torch.Tensor, ctx: ForwardContext) -> None:
        """CED: run only this KV source's compressor over the batch (fills the decoder's global KV)."""
        streams = self.with_engram(streams, ctx, keep_rows=True)  # the replay runs this layer again
        x = self.attn_norm(collapse_streams(streams, pre_mix, self.ops))
        inv_freq = ctx.rope.for_ratio(self.attn.compress_ratio)
        self.attn(x, ctx.batch, inv_freq, ctx.published, ctx.quantizer, compressor_only=True)


class DeepseekV41(DeepseekModel):
    ranks_replay_graphs = False  # a sharded Engram exchange reads sizes on the host

    def __init__(self, config: ModelConfigV41, with_mtp: bool = True, ops: OpTable | None = None) -> None:
        """``ops``: the op table resolved for the device and dtype the model will run on (the loaders pass
        ``resolve(device, dtype)``); None: every op's torch reference."""
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BlockV41(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RopeTables(config)
        stages = config.num_nextn_predict_layers if with_mtp else 0
        self.mtp = nn.ModuleList(DSparkStage(config, i, stages) for i in range(stages))
        if config.vision is not None:  # vision.*, aligner.*, image_{start,newline,end}
            add_image_encoder(self, config.vision, config.hidden_size)
        self.engram_hasher: EngramHasher | None = None
        self.engram_fetcher: EngramRowSource | None = None  # None: read the layers' own tables
        self.quantizer = ActivationQuantizer(enabled=True)
        self.prefill_mode = "exact"
        self.replay_tokens = DEFAULT_REPLAY_TOKENS
        self._first_mix_rows: torch.Tensor | None = None  # see _first_mix
        self._outgrown_first_mix_rows: list[torch.Tensor] = []  # kept alive: captured graphs read them
        self.ops: OpTable = ops if ops is not None else reference_ops()  # the last collapse
        self.use_ops(self.ops)  # every layer

    # ---- settings ----------------------------------------------------------------------------------
    def attach_engram_hasher(self, hasher: EngramHasher) -> DeepseekV41:
        """The hasher (built from the checkpoint's tokenizer) that turns token ids into Engram rows."""
        if tuple(hasher.layer_ids) != tuple(self.config.engram_layer_ids):
            raise ValueError(
                f"the Engram hasher covers layers {list(hasher.layer_ids)}, "
                f"the model {list(self.config.engram_layer_ids)}"
            )
        sizes = hasher.table_sizes()
        for layer_id, rows in zip(self.config.engram_layer_ids, self.config.engram_num_embeddings, strict=True):
            if sizes[layer_id] != rows:
                raise ValueError(
                    f"the Engram hasher addresses {sizes[layer_id]} rows of layer {layer_id}, the table has {rows}"
                )
        self.engram_hasher = hasher.to(self.embed.weight.device)
        return self

    def attach_engram_fetcher(self, fetcher: EngramRowSource | None) -> DeepseekV41:
        """Read Engram rows through ``fetcher`` (None: the layers' own tables) from the next forward on.

        The model owns the fetcher from this call on: :meth:`close`, attaching another, or rejecting it
        (tables that do not fit the model's Engram layers) closes it.
        """
        if fetcher is not None:
            try:
                self._check_engram_fetcher(fetcher)
            except BaseException:
                fetcher.close()
                raise
        if self.engram_fetcher is not None and self.engram_fetcher is not fetcher:
            self.engram_fetcher.close()
        self.engram_fetcher = fetcher
        return self

    def _check_engram_fetcher(self, fetcher: EngramRowSource) -> None:
        if sorted(fetcher.layer_ids) != sorted(self.config.engram_layer_ids):
            raise ValueError(
                f"the Engram fetcher holds tables of layers {sorted(fetcher.layer_ids)}, "
                f"the model has Engram layers {list(self.config.engram_layer_ids)}"
            )
        for layer_id, rows in zip(self.config.engram_layer_ids, self.config.engram_num_embeddings, strict=True):
            if fetcher.rows(layer_id) != rows:
                raise ValueError(
                    f"the Engram fetcher's table of layer {layer_id} has {fetcher.rows(layer_id)} rows, "
                    f"the model addresses {rows}"
                )

    def drop_engram_tables(self) -> DeepseekV41:
        """Remove the layers' own Engram tables (they live outside the model); a fetcher must then be attached."""
        for block in self.layers:
            if block.engram is not None:
                block.engram.embed = None
        return self

    def engram_source(self) -> EngramRowSource:
        """Where this forward reads Engram rows: the attached fetcher, else the layers' own tables."""
        if self.engram_fetcher is not None:
            return self.engram_fetcher
        engrams = {block.layer_id: block.engram for block in self.layers if block.engram is not None}
        tables = {layer_id: engram.embed for layer_id, engram in engrams.items()}
        if any(table is None for table in tables.values()):
            raise RuntimeError(
                "this model's Engram tables live outside it (host or sharded placement) and no fetcher is attached "
                "(closed?); load it again, or attach one with attach_engram_fetcher()"
            )
        # Rows in the layers' GEMM dtype: the layers then convert nothing (the same numbers, see EngramTable).
        return EngramTableFetcher(tables, next(iter(engrams.values())).compute_dtype)

    def close(self) -> None:
        """Release what the model holds outside itself: the Engram fetcher and its shared memory. Idempotent."""
        if self.engram_fetcher is not None:
            fetcher, self.engram_fetcher = self.engram_fetcher, None
            fetcher.close()

    @property
    def fake_quantization(self) -> bool:
        return self.quantizer.enabled

    def set_fake_quantization(self, enabled: bool) -> DeepseekV41:
        """The reference always rounds window KV, compressed KV and indexer q/k; off is for testing only."""
        self.quantizer = ActivationQuantizer(enabled=bool(enabled))
        return self

    def set_prefill_mode(self, mode: str, replay_tokens: int = DEFAULT_REPLAY_TOKENS) -> DeepseekV41:
        """``exact`` (every layer over the whole prompt) or ``bounded`` (CED with a bounded decoder replay)."""
        if mode not in PREFILL_MODES:
            raise ValueError(f"prefill mode: expected one of {list(PREFILL_MODES)}, got {mode!r}")
        if replay_tokens < self.config.sliding_window:
            raise ValueError(
                f"replay_tokens: must be at least the sliding window ({self.config.sliding_window}), "
                f"got {replay_tokens}"
            )
        if mode == "bounded" and self.config.decoder_start is None:
            raise ValueError("bounded prefill needs a CED decoder: the last KV source must have compress ratio 1")
        self.prefill_mode, self.replay_tokens = mode, replay_tokens
        return self

    # ---- forward -----------------------------------------------------------------------------------
    def forward(self, batch: PackedBatch, logits_for: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] for every token, or only for the token indices in ``logits_for``.

        A batch with tokens before their span's ``decoder_from`` runs the bounded (CED) split instead, and then
        ``logits_for`` is required and may name only tokens at or past ``decoder_from``."""
        if self.config.decoder_start is not None and skips_decoder(batch):
            return self._forward_bounded(batch, logits_for)
        streams, pre_mix, _ = self.run_layers(batch)
        return self.logits(self.final_hidden(streams, pre_mix), logits_for)

    def run_layers(
        self, batch: PackedBatch, capture: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """Embedding and every block: streams [T, hc, hidden], the final mix [T, hc], and the context."""
        ctx = self.context(batch, capture)
        streams, pre_mix = self.embed_streams(batch.input_ids, batch.image_splice)
        streams, pre_mix = self.run_range(streams, pre_mix, ctx, 0, len(self.layers))
        return streams, pre_mix, ctx

    def final_hidden(self, streams: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        """Collapse with the last site's mix (no ``hc_head`` in V4.1), then the output norm."""
        return self.norm(collapse_streams(streams, pre_mix, self.ops))

    def encode_images(self, images: list) -> list[torch.Tensor]:
        """Each image's span of embeddings [num_tokens, hidden] (one packed pass through the vision tower)."""
        if self.config.vision is None:
            raise ValueError("this checkpoint has no vision tower (no vision_config): it cannot read images")
        return encode_images(self, images)

    def embed_streams(self, input_ids: torch.Tensor, splice=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams [T, hc, hidden] (the embedding copied, image spans spliced in) and the first site's mix:
        one-hot on stream 0 (read-only: rows of a block the model keeps, see :meth:`_first_mix`).

        Without images and outside autograd the streams are one gather of the embedding rows (each token's id
        once per stream), not the embedding and then a copy into the streams: the same values."""
        weight = self.embed.weight
        if splice is None and not (torch.is_grad_enabled() and weight.requires_grad):
            streams = weight[input_ids.unsqueeze(1).expand(-1, self.config.hc_mult)]
        else:
            embedded = self.embed(input_ids)
            if splice is not None:
                embedded = embedded.index_copy(0, splice.rows, splice.values.to(embedded.dtype))
            streams = self.copy_into_streams(embedded)
        return streams, self._first_mix(streams.shape[0], streams.device)

    def _first_mix(self, tokens: int, device: torch.device) -> torch.Tensor:
        """[tokens, hc] float32, one-hot on stream 0: the first rows of a kept block (nothing writes to the mix),
        made again (rows rounded up to a power of two) only for more tokens or another device, and not kept when
        made while a CUDA graph is captured (its contents exist only at replay). An outgrown block stays alive: a
        graph captured while it was current reads its address at every replay, and freed memory would be handed
        to other tensors."""
        kept = self._first_mix_rows
        if kept is None or kept.shape[0] < tokens or kept.device != device:
            rows = 1 << max(tokens - 1, 0).bit_length()
            kept = torch.zeros(rows, self.config.hc_mult, dtype=torch.float32, device=device)
            kept[:, 0] = 1.0
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                if self._first_mix_rows is not None:
                    self._outgrown_first_mix_rows.append(self._first_mix_rows)
                self._first_mix_rows = kept
        return kept[:tokens]

    def run_range(
        self, streams: torch.Tensor, pre_mix: torch.Tensor, ctx: ForwardContext, first: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers[first:stop]:
            streams, pre_mix = layer(streams, pre_mix, ctx)
        return streams, pre_mix

    def context(self, batch: PackedBatch, capture: bool = False) -> ForwardContext:
        """Scratch cache if needed, Engram rows (advancing each sequence's Engram history), token masks; the
        batch's RoPE angle memo emptied (``step_rope_angles``: an earlier forward's angles may be of other
        positions)."""
        self.ensure_cache(batch)
        batch.rope_angle_memo.clear()
        ctx = ForwardContext(batch, self.rope, self.quantizer, PublishedState.for_batch(batch))
        image_id = self.config.image_token_id
        if image_id is not None:
            ctx.image_mask = batch.input_ids == image_id
            ctx.gate_mask = ~ctx.image_mask
        if self.config.engram_layer_ids:
            ctx.engram_rows = self._engram_rows(batch)
            layer_ids = self.config.engram_layer_ids
            row_ids = {layer_id: ctx.engram_rows[:, index] for index, layer_id in enumerate(layer_ids)}
            ctx.engram_reads = EngramReads(self.engram_source(), row_ids)
        if capture:
            ctx.captured = dict.fromkeys(self.config.dspark_target_layer_ids)
        return ctx

    def _engram_rows(self, batch: PackedBatch) -> torch.Tensor:
        """Every Engram layer's row ids [T, layers, columns]; advances each sequence's Engram history."""
        if self.engram_hasher is None:
            raise RuntimeError("this model has Engram layers: attach an EngramHasher built from its tokenizer first")
        # From the step's device metadata and the host's lengths: no host read. The ids are not range-checked
        # here: the engine checks prompts where they enter, against the hasher's vocabulary too.
        history, spans = batch.cache.engram_history, batch.device_spans
        if batch.is_decode:  # one token per sequence: one op, which advances the histories in place
            return self.engram_hasher.decode_rows(batch.input_ids, history, spans.slots, spans.starts, self.ops)
        fixed = batch.fixed_width
        if fixed is not None and fixed.row_slots is None:  # a verify step: that op once a column, in order
            columns = [
                self.engram_hasher.decode_rows(
                    fixed.column_ids[c], history, fixed.slots, fixed.column_positions[c], self.ops
                )
                for c in range(fixed.width)
            ]
            return torch.stack(columns, dim=1).flatten(0, 1)
        fresh = (spans.starts == 0)[:, None]
        contexts = torch.where(fresh, torch.full_like(history[spans.slots], ENGRAM_DEAD), history[spans.slots])
        rows, next_contexts = self.engram_hasher.prefill_step(
            batch.input_ids, batch.seq_lens, contexts, spans.token_rows + 1
        )
        history[spans.slots] = next_contexts
        return rows

    # ---- prefill (CED) -----------------------------------------------------------------------------
    def prefill(self, batch: PackedBatch, mode: str | None = None, replay_tokens: int | None = None) -> torch.Tensor:
        """Logits [S, vocab] of each sequence's last prompt token, filling the cache for decoding.

        ``exact`` is a plain forward. ``bounded`` (whole prompts from position 0 only): the encoder layers run
        over every token, the first decoder layer's compressor turns their output into the global KV of
        every position, and the decoder layers run only over the last ``replay_tokens`` of each prompt, which
        rebuilds their window caches (:mod:`dsinfer.models.ced`). Later decode steps see the same cache layout
        either way. The engine runs the same split over chunks (``SequenceSpan.decoder_from``).
        """
        mode = self.prefill_mode if mode is None else mode
        replay_tokens = self.replay_tokens if replay_tokens is None else replay_tokens
        if mode == "exact":
            return self(batch, logits_for=batch.last_token_indices())
        self.set_prefill_mode(mode, replay_tokens)  # validates
        if any(span.start for span in batch.spans):
            raise ValueError("bounded prefill runs whole prompts: every sequence must start at position 0")
        spans = [replace(span, decoder_from=span.length - min(replay_tokens, span.length)) for span in batch.spans]
        bounded = PackedBatch(batch.input_ids, batch.positions, spans, batch.cache, batch.image_splice)
        return self(bounded, logits_for=bounded.last_token_indices())

    def _forward_bounded(self, batch: PackedBatch, logits_for: torch.Tensor | None) -> torch.Tensor:
        """The CED split of :mod:`dsinfer.models.ced`: every token through the encoder, the tokens before their
        span's ``decoder_from`` through the first decoder layer's compressor only, the rest through the decoder."""
        if logits_for is None:
            raise ValueError("a bounded (CED) forward gives logits only for the rows named in logits_for")
        decoder = self.config.decoder_start
        ctx = self.context(batch)
        streams, pre_mix = self.embed_streams(batch.input_ids, batch.image_splice)
        streams, pre_mix = self.run_range(streams, pre_mix, ctx, 0, decoder)
        split = split_at_decoder(batch)
        if split.skipped is not None:
            rows = split.skipped_rows
            self.layers[decoder].compress_only(streams[rows], pre_mix[rows], ctx.sliced(split.skipped, rows))
        if split.decoded is None:
            if logits_for.numel():
                raise ValueError("logits_for names rows before decoder_from: those rows have no logits")
            return streams.new_zeros(0, self.config.vocab_size, dtype=torch.float32)
        rows = split.decoded_rows
        decoded_ctx = ctx.sliced(split.decoded, rows)
        streams, pre_mix = self.run_range(streams[rows], pre_mix[rows], decoded_ctx, decoder, len(self.layers))
        return self.logits(self.final_hidden(streams, pre_mix), split.row_in_decoded[logits_for])

    # ---- the served-model contract -----------------------------------------------------------------------
    def cache_block_tokens(self, requested: int | None) -> int:
        """A multiple of the KV sources' ratios only (default 128 positions, so that ratio-1 and ratio-2 index keys fill
        the FP4 scorer's 64-entry tiles)."""
        return block_tokens_for_v41(self.config, requested)

    def build_cache(self, plan: CachePlan) -> KVCacheV41:
        """V4.1's cache; ``with_drafter`` adds the DSpark rings.

        The trained-in rounding makes every cached value exactly representable in its FP8 / FP4 format, so the
        cache keeps codes and scales (3.6x fewer bytes per token than bf16); with the rounding off (testing only)
        it keeps plain values. ``kv_cache_dtype`` bf16 keeps plain values too; fp8 asks for the codes, which the
        rounding must be on for."""
        if plan.kv_cache_dtype == "fp8" and not self.fake_quantization:
            raise ConfigError(
                "--kv-cache-dtype fp8: V4.1's cache keeps FP8 / FP4 codes only under the model's trained-in rounding, "
                "which is off; use auto or bf16"
            )
        quantized = self.fake_quantization and plan.kv_cache_dtype != "bf16"
        return KVCacheV41(
            self.config, plan.num_slots, plan.num_blocks, plan.block_tokens, self.embed.weight.dtype, plan.device,
            with_dspark=plan.with_drafter, quantized_storage=quantized,
        )  # fmt: skip

    def scratch_cache(self, seq_lens: list[int], device: torch.device | str, with_drafter: bool) -> KVCacheV41:
        """A throw-away cache just big enough for whole sequences of ``seq_lens`` run from position 0 (plain
        values: a forward without an engine is how the tests compare against references)."""
        return KVCacheV41.scratch(self.config, seq_lens, self.embed.weight.dtype, device, with_drafter)

    def forward_for_drafter(
        self, batch: PackedBatch, logits_for: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of ``logits_for`` (as :meth:`forward` computes them) and the captured target hiddens
        [T, targets * hidden] the DSpark stages read."""
        streams, pre_mix, ctx = self.run_layers(batch, capture=True)
        targets = torch.cat([ctx.captured[i] for i in self.config.dspark_target_layer_ids], dim=-1)
        return self.logits(self.final_hidden(streams, pre_mix), logits_for), targets

    def check_speculative_support(self, config: SpeculativeConfig) -> None:
        """V4.1 drafts with its DSpark stages (``method: dspark``), at most a block of them."""
        if config.method != "dspark":
            raise ConfigError(
                "speculative_config 'method': 'mtp' needs V4's MTP layers; a V4.1 checkpoint drafts with DSpark stages"
            )
        if not len(self.mtp):
            raise ConfigError(
                "speculative_config 'method': 'dspark' needs the checkpoint's DSpark stages, and this one has none "
                "(no mtp.* tensors)"
            )
        size, k = self.config.dspark_block_size, config.num_speculative_tokens
        if k > size:
            raise ConfigError(
                f"speculative_config 'num_speculative_tokens': {k} exceeds the checkpoint's DSpark block size "
                f"({size}); a block drafts at most {size} tokens"
            )

    def graph_capture_blocker(self, device: torch.device, step_rows: int) -> str | None:
        """V4's rule, and an Engram source whose step-sized fetches run on the device alone."""
        reason = super().graph_capture_blocker(device, step_rows)
        if reason is None and self.config.engram_layer_ids:
            if not self.engram_source().replays_in_graphs(step_rows * self.config.engram_columns):
                return "the Engram placement reads its rows through the host"
        return reason

    def bounded_replay_tokens(self, engine: EngineConfig) -> int | None:
        """The engine's ``v41_replay_tokens`` when prompts prefill bounded (``v41_prefill``; by default when the
        checkpoint has a CED decoder and nothing drafts), else None."""
        config, mode = self.config, engine.v41_prefill
        has_decoder = config.decoder_start is not None
        if mode is None:
            mode = "bounded" if has_decoder and engine.speculative_config is None else "exact"
        replay = f" (replay {engine.v41_replay_tokens})" if mode == "bounded" else ""
        logger.info("V4.1 prompts prefill %s%s", mode, replay)
        if mode == "exact":
            return None
        if not has_decoder:
            last = config.kv_source_layer_ids[-1] if config.kv_source_layer_ids else None
            raise ConfigError(
                "engine option 'v41_prefill': 'bounded' needs a CED decoder, a last KV source of compress ratio 1; "
                + (
                    "this checkpoint has no KV sources"
                    if last is None
                    else f"its last KV source, layer {last}, has ratio {config.compress_ratios[last]}"
                )  # fmt: skip
            )
        if engine.speculative_config is not None:
            raise ConfigError(
                "engine option 'v41_prefill': 'bounded' cannot run with speculative decoding (the drafts read the "
                "decoder's hidden states at every prompt position); use 'exact'"
            )
        if engine.v41_replay_tokens < config.sliding_window:
            raise ConfigError(
                f"engine option 'v41_replay_tokens': must be at least the sliding window ({config.sliding_window}), "
                f"got {engine.v41_replay_tokens}"
            )
        return engine.v41_replay_tokens

    def engram_history_width(self) -> int:
        """The n-gram look-back: ``engram_max_ngram_size - 1`` tokens (0 without Engram layers)."""
        return self.config.engram_max_ngram_size - 1 if self.config.engram_layer_ids else 0

    # ---- DSpark ------------------------------------------------------------------------------------
    def dspark_seed(self, batch: PackedBatch, ctx: ForwardContext) -> None:
        """Write the DSpark rings of the batch's sequences from the target hiddens captured in ``ctx``."""
        self._require_dspark()
        targets = torch.cat([ctx.captured[i] for i in self.config.dspark_target_layer_ids], dim=-1)
        for span, tokens in zip(batch.spans, batch.sequence_slices(), strict=True):
            seed_rings(self.mtp, batch.cache.dspark_rings, span.slot, targets[tokens], batch.positions[tokens],
                       self.rope.window, self.quantizer)  # fmt: skip

    def dspark_draft(self, cache, slot: int, last_position: int, token: int) -> DraftBlock:
        """Draft ``dspark_block_size`` tokens after ``token`` (at ``last_position + 1``) from the slot's rings."""
        self._require_dspark()
        return draft_block(self, cache.dspark_rings, slot, last_position, token)

    def _require_dspark(self) -> None:
        if not len(self.mtp):
            raise RuntimeError("this checkpoint has no DSpark layers (no mtp.* tensors)")
