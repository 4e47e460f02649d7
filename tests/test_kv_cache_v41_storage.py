"""KVCacheV41's quantized storage: FP8 / FP4 codes plus scales give back the rounded values bit for bit.

Three kinds of evidence: the storage formats round-trip every row the fake quantizers can produce (random rows
over many decades, sweeps over every scale and every largest code around the rounding boundaries, the amax
floors, the e4m3-subnormal scale corner, signed zeros), in fp32 and bf16; the tiny V4.1 model's logits are
bit-identical between the two storages for one-shot, chunked, step-by-step, packed and bounded (CED) runs;
and the byte accounting equals the bytes of the tensors actually allocated, also at V4.1-Flash widths.
"""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from dsinfer.config import ModelConfigV41
from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v41 import KVCacheV41, block_tokens_for_v41
from dsinfer.kv.codecs import COMPRESSED_KV_FORMAT, INDEX_KEY_FORMAT, WINDOW_KV_FORMAT
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import tiny_config_v41
from dsinfer.ops.fake_quant import fake_quant_compressed_kv, fake_quant_index, fake_quant_window_kv

FORMATS = {
    "window": (WINDOW_KV_FORMAT, fake_quant_window_kv),
    "compressed": (COMPRESSED_KV_FORMAT, fake_quant_compressed_kv),
    "index": (INDEX_KEY_FORMAT, fake_quant_index),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
E2M1_MAGNITUDES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK_TOKENS = 8
BLOCK_TABLE = [11, 3, 7, 0, 9, 5, 2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns, so -0.0 and 0.0 count as different."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_round_trip(fmt, rounded: torch.Tensor) -> None:
    codes, scales = fmt.encode(rounded)
    channels = rounded.shape[-1]
    assert codes.dtype == fmt.code_dtype and codes.shape[-1] == fmt.code_width(channels)
    assert scales.dtype == fmt.scale_dtype and scales.shape[-1] == channels // fmt.block
    decoded = fmt.decode(codes, scales, rounded.dtype)
    mismatched = (_bits(decoded) != _bits(rounded)).sum()
    assert decoded.dtype == rounded.dtype and int(mismatched) == 0, f"{int(mismatched)} elements differ"


def _e4m3_positive_values() -> torch.Tensor:
    """Every positive finite float8_e4m3fn value (subnormals included), as float32."""
    values = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert values.isfinite().all() and len(values) == 126
    return values


def _blocks_with_maxima(maxima: torch.Tensor, block: int, seed: int) -> torch.Tensor:
    """One block per maximum: the first element is +-max, the others random fractions of it (some exactly 0)."""
    generator = torch.Generator().manual_seed(seed)
    fractions = torch.rand(len(maxima), block, generator=generator) * 2 - 1
    fractions[:, 1] *= 2.0**-12  # tiny elements round to (signed) zero or the smallest codes
    fractions[:, 2] = 0.0
    fractions[:, 0] = torch.where(torch.rand(len(maxima), generator=generator) < 0.5, 1.0, -1.0)
    return (fractions * maxima[:, None]).flatten()[None, :]


def _sweep_maxima(kind: str) -> torch.Tensor:
    """Block maxima around every rounding boundary of a format's scale rule, its floor included."""
    jitter = torch.tensor([0.9, 0.98, 0.999, 1.0, 1.001, 1.02, 1.1])
    if kind == "window":  # every e4m3 code as the largest one, at scales from below the floor (2**-22) up
        codes = _e4m3_positive_values()
        steps = torch.exp2(torch.arange(-32.0, 12.0))
        maxima = (codes[:, None, None] * steps[None, :, None] * jitter).flatten()
    elif kind == "compressed":  # every e4m3 scale (subnormal ones too) times every e2m1 magnitude
        scales = _e4m3_positive_values()
        maxima = (scales[:, None, None] * torch.tensor(E2M1_MAGNITUDES)[None, :, None] * jitter).flatten()
        maxima = maxima[maxima / 6 <= 448]  # above, the e4m3 scale itself overflows (NaN rows)
        maxima = torch.cat([maxima, torch.linspace(0, 6 * 2.0**-7, 400)])  # the floor and e4m3-subnormal region
    else:  # every power-of-two scale from below the floor (6 * 2**-126) up, times every e2m1 magnitude
        steps = torch.exp2(torch.arange(-132.0, 12.0))
        maxima = (steps[:, None, None] * torch.tensor(E2M1_MAGNITUDES)[None, :, None] * jitter).flatten()
    return maxima


# ----------------------------------------------------------------------------------------------- codec
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", FORMATS)
def test_codec_round_trips_random_rows_over_many_decades(kind, dtype):
    fmt, fake_quant = FORMATS[kind]
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(512, 128, generator=generator)
    rows *= torch.exp2(torch.randint(-140, 12, (512, 1), generator=generator).float())  # one decade per row
    rows *= torch.exp2(torch.randn(512, 128, generator=generator) * 3)  # and a spread inside it
    assert_round_trip(fmt, fake_quant(rows.to(dtype)))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", FORMATS)
def test_codec_round_trips_every_scale_and_largest_code(kind, dtype):
    fmt, fake_quant = FORMATS[kind]
    rows = _blocks_with_maxima(_sweep_maxima(kind), fmt.block, seed=2).to(dtype)
    rounded = fake_quant(rows)
    assert torch.isfinite(rounded).all() and not torch.equal(rounded, rows)  # in range, and really rounded
    assert_round_trip(fmt, rounded)


def test_compressed_kv_in_the_e4m3_subnormal_scale_corner():
    """Scale 2**-8 (an e4m3 subnormal) with largest code 4: rounding again would change it, the codec must not."""
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 9.5 * 2.0**-9, -1.1 * 2.0**-9  # amax / 6 rounds up to the subnormal 2 * 2**-9; 4.75 -> 4
    rounded = fake_quant_compressed_kv(x)
    assert rounded[0, 0] == 2.0**-6 and rounded[0, 1] == -(2.0**-9)  # 4 * 2**-8 and -0.5 * 2**-8
    assert not torch.equal(fake_quant_compressed_kv(rounded), rounded)  # the rule alone is not the identity here
    codes, scales = COMPRESSED_KV_FORMAT.encode(rounded)
    assert scales.float().tolist() == [[2.0**-8]]  # the original scale, found among the candidates
    assert_round_trip(COMPRESSED_KV_FORMAT, rounded)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", FORMATS)
def test_codec_keeps_zeros_and_their_signs(kind, dtype):
    fmt, fake_quant = FORMATS[kind]
    rows = torch.zeros(3, 64)
    rows[1] = -0.0
    rows[2, 0], rows[2, 1], rows[2, 2], rows[2, 3] = 1.0, -(2.0**-40), -0.0, 2.0**-40  # tiny ones round to +-0
    rounded = fake_quant(rows.to(dtype))
    zeros = rounded == 0
    assert torch.signbit(rounded[zeros]).any() and not torch.signbit(rounded[zeros]).all()
    assert_round_trip(fmt, rounded)


def test_codec_layouts_by_hand():
    # window KV: e4m3 codes are the values under scale 2**0 (byte 127); a zero block gets the floor 2**-22
    row = torch.zeros(1, 64)
    row[0, :3] = torch.tensor([448.0, -1.0, 2.0**-9])
    codes, scales = WINDOW_KV_FORMAT.encode(fake_quant_window_kv(row))
    assert codes.float()[0, :3].tolist() == [448.0, -1.0, 2.0**-9] and scales.tolist() == [[127, 127 - 22]]
    # index keys: codes 7 (6.0) and 9 (-0.5) share byte 0, low nibble first; scale 2**0
    row = torch.zeros(1, 32)
    row[0, :3] = torch.tensor([6.0, -0.5, 1.5])
    codes, scales = INDEX_KEY_FORMAT.encode(fake_quant_index(row))
    assert codes[0, :2].tolist() == [0x97, 0x03] and scales.tolist() == [[127]]
    # compressed KV: scale e4m3(6.75 / 6) = 1.125; 6.75 -> code 7, -3.375 -> -3 (code 13)
    row = torch.zeros(1, 16)
    row[0, :2] = torch.tensor([6.75, -3.375])
    codes, scales = COMPRESSED_KV_FORMAT.encode(fake_quant_compressed_kv(row))
    assert codes[0, 0] == 0xD7 and scales.float().tolist() == [[1.125]]


def test_codec_refuses_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="window KV: 48 channels are not a whole number of 32-channel blocks"):
        WINDOW_KV_FORMAT.encode(torch.zeros(2, 48))
    codes, scales = INDEX_KEY_FORMAT.encode(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="index keys: expected torch.uint8 codes and torch.uint8 scales"):
        INDEX_KEY_FORMAT.decode(codes.view(torch.int8), scales, torch.float32)


# ----------------------------------------------------------------------------------------------- model
@pytest.fixture(scope="module")
def models(tiny_v41_checkpoint) -> dict[torch.dtype, object]:
    return {dtype: load_model(tiny_v41_checkpoint, dtype=dtype, progress=False) for dtype in DTYPES.values()}


@pytest.fixture(autouse=True)
def _one_thread_and_rounding_on(request, one_torch_thread):
    yield
    if "models" in request.fixturenames:
        for model in request.getfixturevalue("models").values():
            model.set_fake_quantization(True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache(model, quantized: bool, slots: int = 2, blocks: int = 12) -> KVCacheV41:
    dtype = model.embed.weight.dtype
    return KVCacheV41(
        model.config, slots, blocks, BLOCK_TOKENS, dtype, "cpu", with_dspark=True, quantized_storage=quantized
    )


def _run_in_pieces(model, cache, tokens, pieces, slot=1, table=BLOCK_TABLE) -> torch.Tensor:
    logits, start = [], 0
    for length in pieces:
        span = SequenceSpan(start, length, slot, table)
        ids = torch.tensor(tokens[start : start + length])
        logits.append(model(PackedBatch(ids, torch.arange(start, start + length), [span], cache)))
        start += length
    return torch.cat(logits)


def assert_same_contents(plain: KVCacheV41, quantized: KVCacheV41, slot: int, length: int) -> None:
    """What the layers read back (windows of the last positions, every source's entries and keys) is equal."""
    cfg = plain.config
    positions = torch.arange(max(0, length - cfg.sliding_window), length)
    for layer_id, layer in enumerate(plain.layers):
        want = plain.read_window(layer_id, slot, positions)
        assert torch.equal(_bits(quantized.read_window(layer_id, slot, positions)), _bits(want)), layer_id
        if layer.source is not None:
            count = length // layer.source.ratio
            got = quantized.read_entries(layer_id, BLOCK_TABLE, count)
            for g, w in zip(got, plain.read_entries(layer_id, BLOCK_TABLE, count), strict=True):
                assert torch.equal(_bits(g), _bits(w)), layer_id


RUNS = {"one-shot": [40], "chunked": [7, 1, 13, 2, 17], "step-by-step": [28] + [1] * 12}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("run", RUNS)
def test_logits_are_bit_identical_across_storages(models, run, dtype):
    model, pieces = models[dtype], RUNS[run]
    tokens = _tokens(sum(pieces), seed=len(pieces))
    caches = {quantized: _cache(model, quantized) for quantized in (False, True)}
    logits = {quantized: _run_in_pieces(model, cache, tokens, pieces) for quantized, cache in caches.items()}
    assert logits[True].dtype == torch.float32 and torch.isfinite(logits[True]).all()
    assert torch.equal(logits[True], logits[False])
    assert_same_contents(caches[False], caches[True], slot=1, length=len(tokens))


def test_packed_sequences_and_bounded_prefill_are_bit_identical(models):
    """Two sequences in one batch (own slots and block tables), then a CED prefill and decode steps."""
    model = models[torch.float32]
    a, b = _tokens(30, 3), _tokens(21, 4)
    tables = {0: [1, 4, 6, 8], 1: [0, 2, 3]}
    outputs = {}
    for quantized in (False, True):
        cache = _cache(model, quantized)
        steps = []
        for start_a, len_a, start_b, len_b in ((0, 17, 0, 12), (17, 13, 12, 9)):
            spans = [SequenceSpan(start_a, len_a, 0, tables[0]), SequenceSpan(start_b, len_b, 1, tables[1])]
            ids = torch.tensor(a[start_a : start_a + len_a] + b[start_b : start_b + len_b])
            positions = torch.cat([torch.arange(start_a, start_a + len_a), torch.arange(start_b, start_b + len_b)])
            steps.append(model(PackedBatch(ids, positions, spans, cache)))
        bounded = _cache(model, quantized)
        prompt = _tokens(44, 5)
        batch = PackedBatch(torch.tensor(prompt[:40]), torch.arange(40), [SequenceSpan(0, 40, 1, BLOCK_TABLE)], bounded)
        steps.append(model.prefill(batch, mode="bounded", replay_tokens=20))
        for position in range(40, 44):
            span = SequenceSpan(position, 1, 1, BLOCK_TABLE, window_from=20)
            ids = torch.tensor(prompt[position : position + 1])
            steps.append(model(PackedBatch(ids, torch.tensor([position]), [span], bounded)))
        outputs[quantized] = torch.cat(steps)
    assert torch.equal(outputs[True], outputs[False])


def test_dspark_drafts_from_a_quantized_cache(models):
    """The DSpark rings stay in the model dtype; a draft after a quantized-storage forward is unchanged."""
    model = models[torch.float32]
    tokens = _tokens(24, 6)
    drafts = {}
    for quantized in (False, True):
        cache = _cache(model, quantized)
        batch = PackedBatch(torch.tensor(tokens), torch.arange(24), [SequenceSpan(0, 24, 0, BLOCK_TABLE)], cache)
        _, _, ctx = model.run_layers(batch, capture=True)
        model.dspark_seed(batch, ctx)
        drafts[quantized] = model.dspark_draft(cache, 0, last_position=23, token=17)
    assert drafts[True].tokens == drafts[False].tokens
    assert torch.equal(drafts[True].logits, drafts[False].logits)


def test_quantized_storage_refuses_a_model_without_fake_quantization(models):
    model = models[torch.float32]
    model.set_fake_quantization(False)
    tokens = torch.tensor(_tokens(5, 7))
    batch = PackedBatch(tokens, torch.arange(5), [SequenceSpan(0, 5, 0, BLOCK_TABLE)], _cache(model, True))
    with pytest.raises(ValueError, match="only when the model's fake quantization is on"):
        model(batch)
    plain = PackedBatch(tokens, torch.arange(5), [SequenceSpan(0, 5, 0, BLOCK_TABLE)], _cache(model, False))
    assert torch.isfinite(model(plain)).all()  # model-dtype storage holds unrounded values fine


def test_quantized_storage_refuses_widths_without_whole_blocks(models):
    config = replace(models[torch.float32].config, index_head_dim=48)
    KVCacheV41(config, 1, 1, BLOCK_TOKENS, torch.float32, "cpu")  # model-dtype storage does not care
    with pytest.raises(ValueError, match="quantized_storage: the model's index_head_dim does not fit: index keys: 48"):
        KVCacheV41(config, 1, 1, BLOCK_TOKENS, torch.float32, "cpu", quantized_storage=True)


# ----------------------------------------------------------------------------------------------- bytes
def _allocated_bytes(cache: KVCacheV41) -> int:
    """Bytes of every tensor the cache holds, found by walking its dataclasses (new fields count too)."""
    tensors = [cache.engram_history, *cache.dspark_rings]
    for layer in cache.layers:
        tensors += [getattr(layer, f.name) for f in fields(layer)]
        if layer.source is not None:
            tensors += [getattr(layer.source, f.name) for f in fields(layer.source)]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("quantized", [False, True], ids=["model-dtype", "quantized"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_byte_accounting_matches_the_allocated_tensors(dtype, quantized):
    config = tiny_config_v41()

    def cache(slots: int, blocks: int) -> KVCacheV41:
        return KVCacheV41(config, slots, blocks, 16, dtype, "cpu", with_dspark=True, quantized_storage=quantized)

    slots_only, both = cache(3, 0), cache(3, 5)
    spare = both.spare_blocks * both.block_bytes()  # the trash block, allocated beside the pool
    assert both.spare_blocks == 1
    assert _allocated_bytes(slots_only) == 3 * both.slot_bytes() + spare
    assert _allocated_bytes(both) - _allocated_bytes(slots_only) == 5 * both.block_bytes()
    assert both.bytes_per_token() == both.block_bytes() / 16
    if quantized:
        layer = both.layers[1]
        assert layer.window.dtype == torch.float8_e4m3fn and layer.window_scales.dtype == torch.uint8
        assert layer.source.entries.shape[-1] == config.head_dim // 2
        assert layer.source.entry_scales.dtype == torch.float8_e4m3fn
        assert layer.source.index_key_scales.shape[-1] == config.index_head_dim // 32


def test_flash_widths_quantized_storage_is_about_a_quarter_of_bf16():
    """At the released V4.1-Flash layout (40 layers, sources 2, 8, 14 of ratio 2 and 20 of ratio 1, 512-d KV,
    128-d index keys, a 128-token window, 3 DSpark stages), computed on the meta device."""
    config = ModelConfigV41()
    block_tokens = block_tokens_for_v41(config)
    caches = {
        quantized: KVCacheV41(
            config, 2, 3, block_tokens, torch.bfloat16, "meta", with_dspark=True, quantized_storage=quantized
        )
        for quantized in (False, True)
    }
    for cache in caches.values():
        assert _allocated_bytes(cache) == 2 * cache.slot_bytes() + (3 + cache.spare_blocks) * cache.block_bytes()
    plain, quantized = caches[False], caches[True]
    # 2.5 entries per token (three ratio-2 sources, one ratio-1): bf16 (512 + 128) * 2 bytes each, quantized
    # 512 / 2 + 512 / 16 + 128 / 2 + 128 / 32 = 356 bytes each
    assert plain.bytes_per_token() == 2.5 * 1280 == 3200
    assert quantized.bytes_per_token() == 2.5 * 356 == 890
    # per slot: 40 windows of 128 x 512 (bf16: 2 bytes each; quantized: 1 byte + a scale byte per 32), the
    # ratio-2 sources' fp32 unfinished pairs, 3 Engram ids, 3 DSpark rings of 128 x 512 bf16 (not quantized)
    rest = 3 * 2 * 2 * 512 * 4 + 3 * 8 + 3 * 128 * 512 * 2
    assert plain.slot_bytes() == 40 * 128 * 512 * 2 + rest == 5_660_696
    assert quantized.slot_bytes() == 40 * 128 * (512 + 16) + rest == 3_121_176


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "coded"])
def test_a_row_chain_writes_the_bytes_its_rows_would(quantized):
    """A decode step hands the window row, entries and index keys to the cache as :class:`RowChain`s: the pools
    must hold what writing the chains' rows gives (``rope_round_store`` against ``rope_and_round`` + store)."""
    from dsinfer.ops.rope_round import RopeRoundInputs, RowChain

    config = tiny_config_v41()
    caches = [KVCacheV41(config, 2, 6, BLOCK_TOKENS, torch.bfloat16, "cpu", quantized_storage=quantized)
              for _ in range(2)]  # fmt: skip
    ops = caches[0].ops
    generator = torch.Generator().manual_seed(7)
    rope = config.qk_rope_head_dim // 2

    def chain(rows: int, width: int, norm: bool, rounding: str, block: int) -> RowChain:
        x = (torch.randn(rows, width, generator=generator) * 3).bfloat16()
        angles = torch.rand(rows, rope, generator=generator) * 100
        weight = torch.rand(width, generator=generator) + 0.5 if norm else None
        return RowChain(ops, RopeRoundInputs(x, angles.cos(), angles.sin(), weight, 1e-6, rounding, block))

    window = chain(3, config.head_dim, True, "fp8", 32)
    source = next(layer_id for layer_id, layer in enumerate(caches[0].layers) if layer.source is not None)
    entries = chain(2, config.head_dim, False, "fp4_e4m3", 16)
    keys = chain(2, config.index_head_dim, True, "fp4_ue8m0", 32)
    blocks, rows = torch.tensor([4, 1]), torch.tensor([0, 1])
    for cache, computed in zip(caches, (True, False), strict=True):
        written = [part.rows() if computed else part for part in (window, entries, keys)]
        cache.write_window(0, 1, torch.tensor([5, 6, 7 + config.sliding_window]), written[0])
        cache.write_entries_at(source, blocks, rows, written[1], written[2])
    for want, got in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(_bytes(want.window), _bytes(got.window))
        if quantized:
            assert torch.equal(_bytes(want.window_scales), _bytes(got.window_scales))
    want, got = caches[0].layers[source].source, caches[1].layers[source].source
    for name in ("entries", "index_keys", *(("entry_scales", "index_key_scales") if quantized else ())):
        assert torch.equal(_bytes(getattr(want, name)), _bytes(getattr(got, name))), name
    assert _bytes(got.entries).any()  # the writes happened


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)
