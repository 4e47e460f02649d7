"""The indexer's decode kernels against the references, at 1 and 64 requests (interpreted on the CPU; compiled on
CUDA): the split-K scores kernel over bf16, FP8 (ue8m0 and float32 scales, one a row or narrower blocks) and FP4
keys, with visible counts on both sides of every tile and chunk edge; the batched top-k on untied scores on both
sides of each of its edges (one program a row, chunks merged, chunks of ``MAX_WIDTH``, the reference); and the
whole ``indexer_topk_decode`` op, which must choose exactly the reference's entries.

The stated bound on a score: float32 sums in another order, plus (a float32 query, split into two bf16 halves for
the tensor cores) 2^-17 of each product's magnitude: |triton - reference| <= 2^-16 * sum_h |w_h| sum_d |q_hd k_d|
/ sqrt(d) + 1e-6 * (1 + |reference|).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.kv.codecs import INDEX_KEY_FORMAT, INDEX_KEY_FP8_FORMAT
from dsinfer.ops.cache_codec.reference import cache_encode_reference
from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs, decode_paged_keys, index_scores_paged_reference
from dsinfer.ops.index_select.reference import index_topk_decode_reference
from dsinfer.ops.indexer.reference import indexer_topk_decode_reference

TILE = 64  # BLOCK_E of the scores kernel
CHUNK = 2 * TILE  # the chunk the scores cases force (two tiles), so a sequence spans several programs
PER_BLOCK = 16
TABLE_WIDTH = 13  # 208 slots: a partial third chunk
EDGES = (0, 1, TILE - 1, TILE, TILE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 200, 207, 208)


@dataclass(frozen=True)
class ScoresCase:
    batch: int
    form: str  # "bf16", "fp8" (ue8m0, a row), "fp8-float" (float32, a row), "fp8-narrow" (ue8m0 per 32), "fp4"
    q_dtype: torch.dtype = torch.bfloat16
    heads: int = 16
    dim: int = 64
    per_block: int = PER_BLOCK  # slots a block; a multiple of TILE puts every tile inside one block


SCORES_CASES = [
    ScoresCase(1, "bf16"),
    ScoresCase(1, "fp8"),
    ScoresCase(1, "fp8-float", torch.float32),
    ScoresCase(64, "bf16"),
    ScoresCase(64, "fp8"),
    ScoresCase(64, "fp8-narrow", heads=20),
    ScoresCase(64, "fp4", torch.float32),
    ScoresCase(64, "bf16", torch.float32, heads=64, dim=128),
]


def encode_keys(pool: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pool [blocks, per_block, d] in one of the index-key forms (codes and scales through the codec reference)."""
    if form == "bf16":
        return pool.bfloat16(), None
    if form == "fp4":
        return cache_encode_reference(pool, INDEX_KEY_FORMAT.element, INDEX_KEY_FORMAT.block, INDEX_KEY_FORMAT.scale)
    block = pool.shape[-1] if form != "fp8-narrow" else 32
    codes, scales = cache_encode_reference(pool, "e4m3", block, INDEX_KEY_FP8_FORMAT.scale)
    if form == "fp8-float":  # the release's float32 scales (any value, not only powers of two)
        scales = scales.view(torch.float8_e8m0fnu).float() * 1.375
    return codes, scales


def make_inputs(batch: int, heads: int, dim: int, form: str, q_dtype, visible: list[int], generator,
                per_block: int = PER_BLOCK) -> list:  # fmt: skip
    """q, head weights, keys, scales, block tables, visible: each sequence's own blocks (at least the slots of
    ``TABLE_WIDTH`` blocks of ``PER_BLOCK``), the spare one last."""
    width = -(-TABLE_WIDTH * PER_BLOCK // per_block)
    blocks = batch * width + 1
    keys, scales = encode_keys(torch.randn(blocks, per_block, dim, generator=generator), form)
    tables = torch.randperm(blocks - 1, generator=generator)[: batch * width].view(batch, width)
    tables[0, -1] = blocks - 1
    q = torch.randn(batch, heads, dim, generator=generator).to(q_dtype)
    weights = torch.randn(batch, heads, generator=generator) * heads**-0.5
    return [q, weights, keys, scales, tables, torch.tensor(visible)]


def visible_counts(batch: int, generator) -> list[int]:
    """Every edge for one request (one case each), else the edges then random counts."""
    if batch == 1:
        return [EDGES[int(torch.randint(0, len(EDGES), (1,), generator=generator))]]
    extra = torch.randint(0, TABLE_WIDTH * PER_BLOCK + 1, (batch - len(EDGES),), generator=generator).tolist()
    return list(EDGES) + extra


def score_bound(inputs: list) -> torch.Tensor:
    """The stated bound, per score [B, W]."""
    q, weights, keys, scales, tables, _ = inputs
    gathered = decode_paged_keys(keys, scales, tables, q.shape[-1]).float()
    magnitude = torch.einsum("bhd,bwd->bhw", q.float().abs(), gathered.abs())
    magnitude = (magnitude * weights.abs().unsqueeze(-1)).sum(1) * q.shape[-1] ** -0.5
    return magnitude


def check_scores(
    case: ScoresCase, device: torch.device, generator, fp4_layout: str = "halves", visible: list[int] | None = None
) -> str | None:
    """The scores kernel (FP4 tiles in ``fp4_layout``) against the reference on random inputs whose sequences see
    ``visible`` entries each (None: :func:`visible_counts`)."""
    import dsinfer.ops.index_scores_paged.triton as backend

    visible = visible if visible is not None else visible_counts(case.batch, generator)
    inputs = make_inputs(case.batch, case.heads, case.dim, case.form, case.q_dtype, visible, generator, case.per_block)
    inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs]
    if not backend.serves(inputs[0], inputs[2], inputs[3]):
        return f"{case}: the kernel does not take it"
    want = index_scores_paged_reference(PagedIndexInputs(*inputs))
    got = backend.paged_scores_launch(PagedIndexInputs(*inputs), chunk=CHUNK, fp4_layout=fp4_layout)
    finite = torch.isfinite(want)
    if got.shape != want.shape or not torch.equal(torch.isfinite(got), finite):
        return f"{case} visible={visible[:3]}: shape or -inf pattern differs"
    if not torch.equal(got[want == 0], want[want == 0]):
        return f"{case}: exact zeros differ"
    bound = 2.0**-16 * score_bound(inputs) + 1e-6 * (1 + want.abs())
    excess = (got - want).abs() - bound
    if finite.any() and excess[finite].max() > 0:
        return f"{case}: |triton - reference| beyond the bound by {excess[finite].max().item():.3g}"
    return None


def untied_scores(rows: int, width: int, generator) -> torch.Tensor:
    """Distinct random float32 scores (a permutation scaled), a causal -inf tail on some rows."""
    scores = torch.stack([torch.randperm(width, generator=generator) for _ in range(rows)]).float() / width - 0.5
    scores[rows // 2 :, width - width // 3 :] = float("-inf")
    return scores


TOPK_CASES = [  # rows, width, k: both sides of the one-program edge (CHUNK), the merge tiers, the reference's
    (1, 4096, 512),
    (1, 4097, 512),
    (64, 4097, 64),
    (1, 20000, 4096),  # chunks of 4096 keep too many candidates: chunks of 8192
    (1, 40000, 4096),  # and of 16384
    (1, 70000, 4096),  # still too many: the reference
    (64, 300, 512),  # k wider than the row
]


def check_topk(rows: int, width: int, k: int, device: torch.device, generator) -> str | None:
    from dsinfer.ops.index_select.triton import index_topk_decode_triton

    scores = untied_scores(rows, width, generator).to(device)
    allowed = (torch.rand(rows, width, generator=generator) < 0.9).to(device)
    for mask in (None, allowed):
        if not torch.equal(index_topk_decode_triton(scores, k, mask), index_topk_decode_reference(scores, k, mask)):
            return f"top-k rows={rows} width={width} k={k} allowed={mask is not None}: another choice"
    return None


OP_CASES = [("bf16", 1), ("fp8", 1), ("bf16", 64), ("fp8", 64)]


def check_op(form: str, batch: int, device: torch.device, generator) -> str | None:
    """The whole decode op: the reference's entries (ascending, then padding) on untied random scores."""
    import dsinfer.ops.indexer.triton as backend

    visible = visible_counts(batch, generator)
    q, weights, keys, scales, tables, visible = make_inputs(batch, 16, 64, form, torch.bfloat16, visible, generator)
    scales = None if scales is None else scales.to(device)
    args = PagedIndexInputs(*(t.to(device) for t in (q, weights, keys)), scales, tables.to(device), visible.to(device))
    for k in (8, 100):
        chosen, real = backend.indexer_topk_decode_triton(args, k)
        want, want_real = indexer_topk_decode_reference(args, k)
        if not (torch.equal(real, want_real) and torch.equal(chosen[real], want[want_real])):
            return f"op {form} batch={batch} k={k}: another choice"
    return None


def check(device: torch.device) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    messages = [check_scores(case, device, generator) for case in SCORES_CASES]
    messages += [check_topk(*case, device, generator) for case in TOPK_CASES]
    messages += [check_op(form, batch, device, generator) for form, batch in OP_CASES]
    return [message for message in messages if message]


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()
    return check(torch.device("cpu"))


def test_kernels_match_the_references_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_index_decode")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter test covers the CPU)")
def test_kernels_match_the_references_on_cuda():
    assert check(torch.device("cuda")) == []


def test_fp8_index_keys_round_trip_as_the_release_rounds():
    """The FP8 codec's values are the release's: e4m3 codes under 2**ceil(log2(amax / 448)) per 128 channels."""
    keys = torch.randn(3, 5, 128) * torch.logspace(-3, 2, 5).view(1, 5, 1)
    codes, scales = INDEX_KEY_FP8_FORMAT.encode(keys)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (3, 5, 1)
    scale = torch.exp2(torch.ceil(torch.log2(keys.abs().amax(-1, keepdim=True) / 448.0)))
    assert torch.equal(scales.view(torch.float8_e8m0fnu).float(), scale)
    rounded = (keys / scale).to(codes.dtype).float() * scale
    assert torch.equal(INDEX_KEY_FP8_FORMAT.decode(codes, scales, torch.float32), rounded)


def test_reference_refuses_malformed_key_pools():
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="index key scales"):
        decode_paged_keys(
            torch.zeros(2, 4, 64, dtype=torch.float8_e4m3fn),
            torch.zeros(2, 4, 3),
            torch.zeros(1, 1, dtype=torch.long),
            64,
        )
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        index_scores_paged_reference(PagedIndexInputs(q, torch.ones(1, 4), torch.zeros(2, 4, 64), torch.zeros(2, 4, 1),
                                                      torch.zeros(1, 1, dtype=torch.long),
                                                      torch.ones(1, dtype=torch.long)))  # fmt: skip
