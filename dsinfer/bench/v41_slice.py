"""V4.1-Flash-width slices for measuring without the checkpoint: the config, a tokenizer-free hasher, and Engram
tables of a chosen size in host shared memory read through the real store and fetch path.

No V4.1 tokenizer ships with random weights, so the Engram hasher's compressed vocabulary is synthetic (token id
modulo the compressed vocabulary size): every token still hashes to rows spread over the whole table, which is
what the fetch's cost depends on. The tables are random FP8 rows with ue8m0 scales
(:class:`~dsinfer.engram.store.RandomEngramSource`) in one shared-memory segment
(:class:`~dsinfer.engram.store.EngramStore`), read by the ``host`` placement's fetcher, as a served V4.1 reads
the release's 203 GB of tables that no GPU holds.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from dsinfer.config import FP8_SCALE_BLOCK, ModelConfigV41, QuantizationConfig
from dsinfer.engram.hashing import EngramHasher
from dsinfer.engram.placement import PlacedEngramTables
from dsinfer.engram.store import EngramStore, RandomEngramSource, default_segment_name
from dsinfer.engram.store.segment import ENGRAM_ROW_BYTES

SLICE_ENGRAM_VOCAB = 100_000  # 24 primes above 1e5: a 2.4M-row table (634 MB) instead of the release's 384M rows
TILE_ROWS = 1 << 16  # one random block repeated over the table: fills tens of GiB at memory speed


def v41_slice_config(num_layers: int, experts: int = 384) -> ModelConfigV41:
    """Every V4.1-Flash width (hidden 5120, 64 heads x 512, q rank 1280, indexer 32 x 128 top 512, 2048 candidate
    blocks of 8, window 128, Engram heads 8 x 256) over ``num_layers`` layers with ``experts`` routed experts.

    The layers keep the release's roles in its order: a window layer with Engram, then the ratio-2 encoder (its
    first layer the KV and index source, the rest reading it), then the ratio-1 decoder (its first layer the KV,
    index and candidate source, every other layer after it a keyless index source). Four layers give
    ``(0, 2, 1, 1)``: window + Engram, a ratio-2 source, the ratio-1 decoder source, a keyless index source.
    """
    if num_layers < 2:
        raise ValueError(f"--flash-layers: a V4.1 slice needs at least 2 layers (window, decoder), got {num_layers}")
    encoder = (num_layers - 1) // 2
    decoder_start = 1 + encoder
    ratios = (0,) + (2,) * encoder + (1,) * (num_layers - decoder_start)
    kv_sources = ((1,) if encoder else ()) + (decoder_start,)
    keyless = tuple(range(decoder_start + 1, num_layers, 2))
    return ModelConfigV41(
        num_hidden_layers=num_layers,
        compress_ratios=ratios,
        kv_source_layer_ids=kv_sources,
        index_source_layer_ids=kv_sources + keyless,
        candidate_source_layer_id=decoder_start,
        n_routed_experts=experts,
        engram_layer_ids=(0,),
        engram_vocab_size=SLICE_ENGRAM_VOCAB,
        num_nextn_predict_layers=1,
        dspark_target_layer_ids=tuple(range(max(1, num_layers - 3), num_layers)),
        quantization=QuantizationConfig(weight_block_size=(32, 32)),
    )


def with_engram_gib(config: ModelConfigV41, gib: float) -> ModelConfigV41:
    """``config`` with an Engram vocabulary whose tables take about ``gib`` GiB in host memory (FP8 rows + scales):
    each table has ``(max_ngram - 1) x heads`` bucket primes just above the vocabulary as rows."""
    if gib <= 0:
        raise ValueError(f"--engram-gib: must be positive, got {gib}")
    if not config.engram_layer_ids:
        return config
    record = config.engram_head_dim + config.engram_head_dim // FP8_SCALE_BLOCK
    rows_per_table = gib * 2**30 / record / len(config.engram_layer_ids)
    vocab = max(int(rows_per_table / config.engram_columns), config.engram_compressed_vocab_size + 1)
    return replace(config, engram_vocab_size=vocab, engram_num_embeddings=())


def engram_table_bytes(config: ModelConfigV41) -> int:
    """Bytes of every Engram table of ``config`` in the store (FP8 rows and their scales)."""
    record = config.engram_head_dim + config.engram_head_dim // FP8_SCALE_BLOCK
    return sum(config.engram_num_embeddings) * record


def synthetic_hasher(config: ModelConfigV41) -> EngramHasher:
    """A many-to-one compressed vocabulary of the configured size (no tokenizer needed)."""
    table = torch.arange(config.vocab_size) % config.engram_compressed_vocab_size
    return EngramHasher(table, **config.engram_hasher_options())


def host_engram_tables(config: ModelConfigV41, device: torch.device | str, dtype: torch.dtype, seed: int = 0):
    """Random Engram tables of ``config``'s shape in one host shared-memory segment, behind the ``host``
    placement's fetcher (rows read in place by the GPU; on the CPU, from the segment's pages)."""
    from dsinfer.engram.fetch import make_engram_fetcher

    if config.engram_head_dim != ENGRAM_ROW_BYTES:
        raise ValueError(
            f"engram_head_dim {config.engram_head_dim}: the shared-memory store holds rows of {ENGRAM_ROW_BYTES} "
            "FP8 bytes (the release's); random host tables need a config with that Engram head size"
        )
    source = RandomEngramSource(_table_rows(config), seed=seed, tile_rows=TILE_ROWS)
    store = EngramStore.create(default_segment_name(f"bench-{os.getpid()}"), source)
    try:
        fetcher = make_engram_fetcher(store, "host", device=device, out_dtype=dtype)
    except BaseException:
        store.close()
        raise
    return PlacedEngramTables("host", fetcher, store)


def attach_engram(model, seed: int = 0):
    """Give a V4.1 model built without its tables (``engram_tables=False``) the synthetic hasher and host tables."""
    config = model.config
    if not config.engram_layer_ids:
        return model
    model.attach_engram_hasher(synthetic_hasher(config))
    model.attach_engram_fetcher(host_engram_tables(config, model.embed.weight.device, model.embed.weight.dtype, seed))
    return model


def _table_rows(config: ModelConfigV41) -> dict[int, int]:
    return dict(zip(config.engram_layer_ids, config.engram_num_embeddings, strict=True))
