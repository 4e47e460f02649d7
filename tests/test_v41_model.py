"""DeepSeek-V4.1 forward through the cache: chunked prefill and step-by-step decoding equal one full forward.

The tiny checkpoint has every layer role (window-only, ratio-2 KV + index sources and their reusers, a
second ratio-2 source, the ratio-1 candidate source, a keyless index source, reusers), Engram on two
layers and two DSpark stages. No PyPI release of ``transformers`` runs V4.1, so these tests check
properties only a correct cached implementation has, plus the layer-role wiring.
"""

from __future__ import annotations

import pytest
import torch

from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.layers.csa2_prefill import candidate_entries
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.loader import load_model
from dsinfer.ops.fake_quant import ActivationQuantizer
from dsinfer.ops.sparse_attention.prefill_reference import chosen_mask, sequence_entries

BLOCK_TOKENS = 8  # small blocks so a sequence crosses many, through a scattered block table
BLOCK_TABLE = [20, 3, 7, 11, 0, 5, 9, 14, 2, 17, 22, 1, 13, 6, 19, 4]


@pytest.fixture(scope="module")
def model(tiny_v41_checkpoint) -> DeepseekV41:
    return load_model(tiny_v41_checkpoint, progress=False)


@pytest.fixture(autouse=True)
def _restore_settings(model):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention
    yield
    torch.set_num_threads(threads)
    model.set_fake_quantization(True)
    model.set_prefill_mode("exact")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache(model, slots: int = 3, blocks: int = 24) -> KVCacheV41:
    return KVCacheV41(model.config, slots, blocks, BLOCK_TOKENS, torch.float32, "cpu", with_dspark=True)


def assert_close(got: torch.Tensor, want: torch.Tensor, tolerance: float = 1e-5) -> None:
    """Max deviation within ``tolerance`` of the logits' scale (their largest magnitude).

    Both orders round differently in float32 (matmuls of different shapes); across 9 layers that noise is
    about 3e-6 of the logit scale, with rare elements near 1e-5 in absolute terms.
    """
    error = float((got - want).abs().max() / want.abs().max())
    assert error <= tolerance, f"max deviation {error:.2e} of the logit scale"


def _run_in_pieces(model, cache, tokens, pieces, slot=1, table=BLOCK_TABLE):
    logits, start = [], 0
    for length in pieces:
        span = SequenceSpan(start, length, slot, table)
        batch = PackedBatch(
            torch.tensor(tokens[start : start + length]), torch.arange(start, start + length), [span], cache
        )
        logits.append(model(batch))
        start += length
    return torch.cat(logits)


def test_tiny_config_has_every_layer_role(model):
    cfg = model.config
    assert cfg.compress_ratios == (0, 2, 2, 2, 2, 1, 1, 1, 1)
    kinds = [
        (cfg.is_kv_source(i), cfg.is_index_source(i), cfg.kv_source_of(i), cfg.index_source_of(i))
        for i in range(cfg.num_hidden_layers)
    ]
    assert kinds == [
        (False, False, None, None),  # window only
        (True, True, 1, 1),  # ratio-2 KV + index source
        (False, False, 1, 1),  # reuses layer 1
        (True, True, 3, 3),  # a second ratio-2 source: replaces layer 1's entries
        (False, False, 3, 3),
        (True, True, 5, 5),  # ratio-1 source, candidate source, CED decoder start
        (False, False, 5, 5),
        (False, True, 5, 7),  # keyless index source: re-scores layer 5's keys inside the candidates
        (False, False, 5, 7),
    ]
    assert cfg.candidate_source_layer_id == 5 and cfg.decoder_start == 5 and cfg.uses_candidates(7)
    assert model.layers[7].attn.indexer.owns_keys is False and model.layers[5].attn.indexer.owns_keys is True
    assert cfg.engram_layer_ids == (1, 6) and model.engram_hasher is not None
    assert len(model.mtp) == 2
    assert model.fake_quantization is True  # the reference's default


class ReplayQuantizer(ActivationQuantizer):
    """Rounds like the model, but can replay the rounding decisions recorded during another run.

    Two evaluation orders (one full forward, chunks) compute the same pre-quantization values up to
    float32 reassociation noise (~1e-7); a value within that noise of a rounding midpoint then lands on
    different FP8 / FP4 codes. Replaying the recorded codes for such rows (after checking their inputs
    did agree to rounding noise) shows every remaining difference is reassociation noise, not the cache.
    """

    def __init__(self) -> None:
        super().__init__(enabled=True)
        self.recorded: dict = {}
        self.replaying = False
        self.replayed = 0

    def _apply(self, kind, x, rounded, layer, ids):
        out = rounded.clone()
        for row, key_id in enumerate(ids.tolist()):
            if key_id < 0:  # a decode step's unfinished window, written to the trash block
                continue
            key = (kind, layer, key_id)
            if not self.replaying:
                self.recorded[key] = (x[row].clone(), rounded[row].clone())
                continue
            recorded_input, recorded_output = self.recorded[key]
            if not torch.equal(rounded[row], recorded_output):
                noise = (x[row] - recorded_input).abs().max()
                assert noise <= 1e-4 * recorded_input.abs().max() + 1e-9, (key, float(noise))
                out[row] = recorded_output
                self.replayed += 1
        return out

    def window_kv(self, x, layer, positions):
        return self._apply("window", x, super().window_kv(x, layer, positions), layer, positions)

    def compressed_kv(self, x, layer, entry_ids):
        return self._apply("compressed", x, super().compressed_kv(x, layer, entry_ids), layer, entry_ids)

    def index_keys(self, x, layer, entry_ids):
        return self._apply("keys", x, super().index_keys(x, layer, entry_ids), layer, entry_ids)

    def index_queries(self, x, layer, positions):
        return self._apply("queries", x, super().index_queries(x, layer, positions), layer, positions)


PIECES = [[7, 1, 33, 2, 37], [31, 32, 1, 16], [64, 1, 1, 14], [3] * 26 + [2], [1] * 80]


@pytest.mark.parametrize("pieces", PIECES)
def test_pieces_equal_one_full_forward_without_quantization(model, pieces):
    """Chunked prefill (any chunk sizes) and step-by-step decoding give the full forward's logits."""
    model.set_fake_quantization(False)
    tokens = _tokens(80, seed=len(pieces))
    full = model(PackedBatch.from_sequences([tokens]))
    got = _run_in_pieces(model, _cache(model), tokens, pieces)
    assert_close(got, full)
    assert torch.equal(got.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("seed", [0, 27])
@pytest.mark.parametrize("pieces", PIECES)
def test_pieces_equal_one_full_forward_with_quantization(model, pieces, seed):
    """With the trained-in rounding on, the two orders agree up to rounding decisions at midpoints."""
    quantizer = ReplayQuantizer()
    model.quantizer = quantizer
    tokens = _tokens(80, seed=seed + len(pieces))
    full = model(PackedBatch.from_sequences([tokens]))
    quantizer.replaying = True
    got = _run_in_pieces(model, _cache(model), tokens, pieces)
    assert_close(got, full)
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    kinds = {key[0] for key in quantizer.recorded}
    assert kinds == {"window", "compressed", "keys", "queries"}  # every quantization point ran
    assert quantizer.replayed <= 40  # a handful of midpoint rows at most, out of thousands


def test_packed_sequences_share_one_cache(model):
    """Several sequences in one batch, at different stages, stay independent through slots and block tables."""
    model.set_fake_quantization(False)  # rounding-decision flips are covered by the replay test above
    a, b, c = _tokens(50, 1), _tokens(37, 2), _tokens(20, 3)
    cache = _cache(model, slots=3, blocks=24)
    tables = {0: [0, 3, 5, 8, 10, 12, 14], 1: [1, 2, 4, 6, 9], 2: [7, 11, 13]}
    seqs = {0: a, 1: b, 2: c}
    outputs, starts = {0: [], 1: [], 2: []}, {0: 0, 1: 0, 2: 0}
    for step in ([(0, 17), (1, 20)], [(0, 1), (1, 9), (2, 20)], [(0, 32), (1, 8)]):
        spans, ids, positions = [], [], []
        for slot, length in step:
            start = starts[slot]
            spans.append(SequenceSpan(start, length, slot, tables[slot]))
            ids += seqs[slot][start : start + length]
            positions += range(start, start + length)
            starts[slot] += length
        logits = model(PackedBatch(torch.tensor(ids), torch.tensor(positions), spans, cache))
        offset = 0
        for slot, length in step:
            outputs[slot].append(logits[offset : offset + length])
            offset += length
    for slot, seq in seqs.items():
        full = model(PackedBatch.from_sequences([seq]))
        assert_close(torch.cat(outputs[slot]), full)


def test_later_sources_replace_earlier_entries(model, monkeypatch):
    """Layer 4 attends to layer 3's compressed entries only (the cached path's replace semantics)."""
    seen = {}
    attention = model.layers[4].attn
    original = type(attention)._attend_packed

    def record(self, q, kv, batch, cache, entries, tables, indices, ratio):
        count = (batch.spans[0].start + batch.spans[0].length) // ratio  # what the op reads of one sequence
        seen["compressed"] = sequence_entries(entries, tables[0], count).clone()
        seen["visible"] = chosen_mask(indices, count)
        return original(self, q, kv, batch, cache, entries, tables, indices, ratio)

    monkeypatch.setattr(attention, "_attend_packed", record.__get__(attention))
    tokens = _tokens(41, 7)
    cache = _cache(model)
    _run_in_pieces(model, cache, tokens, [41])
    entries_3, _ = cache.read_entries(3, BLOCK_TABLE, 41 // 2)
    entries_1, _ = cache.read_entries(1, BLOCK_TABLE, 41 // 2)
    assert torch.equal(seen["compressed"], entries_3) and not torch.equal(entries_1, entries_3)
    assert seen["visible"].shape == (41, 20)
    assert int(seen["visible"].sum(-1).max()) <= model.config.index_topk


def test_keyless_index_source_chooses_inside_the_candidate_blocks(model):
    cfg = model.config
    tokens = _tokens(90, 9)
    _, _, ctx = model.run_layers(PackedBatch.from_sequences([tokens]))
    state = ctx.published.sequences[0]  # after the last layer: candidates of layer 5, selection of layer 7
    candidates = candidate_entries(state.candidate_blocks, cfg.candidate_block_size, 90)
    selected = chosen_mask(ctx.published.prefill.indices, 90)  # layer 7's choice
    assert selected.shape == candidates.shape == (90, 90)
    assert not (selected & ~candidates).any()
    visible = torch.arange(90)[None, :] <= torch.arange(90)[:, None]  # ratio 1: entry j visible from position j
    allowed = (candidates & visible).sum(-1)
    assert torch.equal(selected.sum(-1), allowed.clamp(max=cfg.index_topk))
    padded = torch.nn.functional.pad(candidates, (0, -90 % cfg.candidate_block_size))
    blocks = padded.view(90, -1, cfg.candidate_block_size).any(-1).sum(-1)
    assert int(blocks.max()) == cfg.candidate_topk_blocks
    newest = torch.arange(90)
    assert candidates[newest, newest].all()  # the block holding a query's own entry is always a candidate


def test_engram_layers_change_the_output(model):
    tokens = _tokens(30, 11)
    base = model(PackedBatch.from_sequences([tokens]))
    table = model.layers[6].engram.embed.scale
    saved = table.clone()
    try:
        table.zero_()  # every row reads as zeros: a constant key / value
        assert not torch.allclose(model(PackedBatch.from_sequences([tokens])), base, atol=1e-3)
    finally:
        table.copy_(saved)


def test_engram_history_survives_slot_reuse(model):
    """A fresh sequence (start 0) ignores what an earlier sequence left in the slot's Engram history."""
    model.set_fake_quantization(False)
    cache = _cache(model)
    _run_in_pieces(model, cache, _tokens(25, 12), [25], slot=0, table=[4, 5, 6, 7])
    tokens = _tokens(30, 13)
    got = _run_in_pieces(model, cache, tokens, [12, 18], slot=0, table=[8, 9, 10, 11])
    assert_close(got, model(PackedBatch.from_sequences([tokens])))


# ----------------------------------------------------------------------------------------------- CED
def test_bounded_prefill_equals_exact_when_the_prompt_fits_the_replay(model):
    model.set_fake_quantization(False)
    tokens = _tokens(60, 21)
    exact = model.prefill(PackedBatch.from_sequences([tokens]), mode="exact")
    bounded = model.prefill(PackedBatch.from_sequences([tokens]), mode="bounded", replay_tokens=60)
    assert_close(bounded, exact)


def test_bounded_prefill_builds_the_exact_global_kv_and_decodes_on(model):
    cfg = model.config
    tokens = _tokens(100, 22)
    caches = {}
    for mode in ("exact", "bounded"):
        cache = _cache(model)
        span = SequenceSpan(0, 90, 1, BLOCK_TABLE)
        logits = model.prefill(PackedBatch(torch.tensor(tokens[:90]), torch.arange(90), [span], cache), mode, 20)
        assert logits.shape == (1, cfg.vocab_size)
        for position in range(90, 100):  # decoding continues on the bounded cache
            step = SequenceSpan(position, 1, 1, BLOCK_TABLE, window_from=70 if mode == "bounded" else 0)
            batch = PackedBatch(torch.tensor(tokens[position : position + 1]), torch.tensor([position]), [step], cache)
            assert torch.isfinite(model(batch)).all()
        caches[mode] = cache
    exact, bounded = caches["exact"], caches["bounded"]
    decoder = cfg.decoder_start
    # The decoder's global KV (entries and index keys of every prompt position) comes out the same...
    for layer in range(decoder + 1):
        source = exact.layers[layer].source
        if source is not None:
            got = bounded.read_entries(layer, BLOCK_TABLE, 100 // source.ratio)
            want = exact.read_entries(layer, BLOCK_TABLE, 100 // source.ratio)
            assert all(torch.allclose(g, w, rtol=0, atol=1e-6) for g, w in zip(got, want, strict=True)), layer
    # ...and so do the windows of every layer whose input the encoder alone decides (up to the first decoder
    # layer's own window); the later decoder windows only approximate the exact ones.
    for layer in range(decoder + 1):
        assert torch.allclose(bounded.layers[layer].window[1], exact.layers[layer].window[1], rtol=0, atol=1e-6)
    assert not torch.allclose(bounded.layers[decoder + 1].window[1], exact.layers[decoder + 1].window[1], atol=1e-6)


def test_bounded_prefill_drifts_but_stays_close(model):
    tokens = _tokens(200, 23)
    exact = model.prefill(PackedBatch.from_sequences([tokens]), mode="exact")
    bounded = model.prefill(PackedBatch.from_sequences([tokens]), mode="bounded", replay_tokens=40)
    drift = (bounded - exact).abs().max()
    assert 0 < drift < 0.5 * exact.abs().max()


def test_prefill_mode_flag_is_validated(model):
    with pytest.raises(ValueError, match="prefill mode"):
        model.set_prefill_mode("lazy")
    with pytest.raises(ValueError, match="replay_tokens: must be at least the sliding window"):
        model.set_prefill_mode("bounded", replay_tokens=4)
    model.set_prefill_mode("bounded", replay_tokens=20)
    tokens = _tokens(50, 24)
    assert torch.equal(
        model.prefill(PackedBatch.from_sequences([tokens])),
        model.prefill(PackedBatch.from_sequences([tokens]), mode="bounded", replay_tokens=20),
    )
    with pytest.raises(ValueError, match="whole prompts"):
        cache = _cache(model)
        model.prefill(PackedBatch(torch.tensor(tokens[:5]), torch.arange(5, 10), [SequenceSpan(5, 5, 0, [0])], cache))


# ----------------------------------------------------------------------------------------------- DSpark
def test_dspark_drafts_from_rings_seeded_in_pieces(model):
    cfg = model.config
    model.set_fake_quantization(False)  # compares two evaluation orders: keep rounding decisions out of it
    tokens = _tokens(40, 31)
    cache = _cache(model)
    start = 0
    for length in (23, 1, 16):
        batch = PackedBatch(
            torch.tensor(tokens[start : start + length]),
            torch.arange(start, start + length),
            [SequenceSpan(start, length, 2, BLOCK_TABLE)],
            cache,
        )
        _, _, ctx = model.run_layers(batch, capture=True)
        model.dspark_seed(batch, ctx)
        start += length
    draft = model.dspark_draft(cache, 2, last_position=39, token=17)
    one_shot = PackedBatch.from_sequences([tokens])
    _, _, ctx = model.run_layers(one_shot, capture=True)
    model.dspark_seed(one_shot, ctx)
    for stage in range(len(model.mtp)):
        assert torch.allclose(cache.dspark_rings[stage][2], one_shot.cache.dspark_rings[stage][0], atol=1e-5)
    again = model.dspark_draft(one_shot.cache, 0, last_position=39, token=17)
    assert draft.tokens == again.tokens and torch.allclose(draft.logits, again.logits, atol=1e-5)
    assert draft.logits.shape == (cfg.dspark_block_size, cfg.vocab_size) and draft.confidence.shape == (3,)
    assert draft.tokens == draft.logits.argmax(-1).tolist()  # greedy over the Markov-biased columns


def test_dspark_markov_bias_depends_on_the_previous_draft(model):
    tokens = _tokens(30, 32)
    batch = PackedBatch.from_sequences([tokens])
    _, _, ctx = model.run_layers(batch, capture=True)
    model.dspark_seed(batch, ctx)
    markov = model.mtp[-1].markov_head.head.weight
    saved = markov.clone()
    try:
        biased = model.dspark_draft(batch.cache, 0, 29, 17)
        markov.zero_()
        plain = model.dspark_draft(batch.cache, 0, 29, 17)
    finally:
        markov.copy_(saved)
    assert not torch.allclose(biased.logits, plain.logits)
    bias = biased.logits - plain.logits  # one Markov row per position, chosen by the previous token
    previous = [17, *biased.tokens[:-1]]
    last = model.mtp[-1].markov_head
    expected = last.head(last.embed(torch.tensor(previous))).float()
    assert torch.allclose(bias, expected, atol=1e-4)
