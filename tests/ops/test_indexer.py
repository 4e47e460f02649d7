"""indexer_topk_decode: the Triton scores kernel (in Triton's CPU interpreter; compiled on CUDA) against the
reference, on random shapes with the edges (no visible entry, a tile boundary, fewer visible entries than k)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hopper_build import register_spills
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs
from dsinfer.ops.indexer.reference import indexer_scores, indexer_topk_decode_reference


@dataclass(frozen=True)
class Case:
    visible: tuple[int, ...]  # entries each sequence's query may see
    heads: int = 8
    dim: int = 32
    per_block: int = 4
    table_width: int = 10
    k: int = 6
    dtype: torch.dtype = torch.float32  # the key cache's dtype
    seed: int = 0


CASES = [
    Case(visible=(0,)),  # nothing visible yet: every chosen slot is padding
    Case(visible=(3, 40, 17, 33), seed=1),  # fewer than k; every slot; the BLOCK_E = 32 boundary either side
    Case(visible=(1, 2), k=50, seed=2),  # k wider than the table: k' = 40
    Case(visible=(150, 7, 64), heads=20, dim=48, per_block=8, table_width=20, k=16, seed=3),  # head / dim tails
    Case(visible=(90, 5), heads=64, dim=128, per_block=32, table_width=3, k=32, dtype=torch.bfloat16, seed=4),
]


def make_inputs(case: Case) -> dict:
    gen = torch.Generator().manual_seed(case.seed)
    batch = len(case.visible)
    blocks = batch * case.table_width + 2
    return {
        "q": torch.randn(batch, case.heads, case.dim, generator=gen),
        "head_weights": torch.randn(batch, case.heads, generator=gen) * case.heads**-0.5,
        "keys": torch.randn(blocks, case.per_block, case.dim, generator=gen).to(case.dtype),
        "block_tables": torch.randperm(blocks, generator=gen)[: batch * case.table_width].view(batch, -1),
        "visible": torch.tensor(case.visible),
        "k": case.k,
    }


def op_arguments(inputs: dict) -> tuple[PagedIndexInputs, int]:
    """``indexer_topk_decode``'s arguments for a case's tensors (plain keys: no key scales)."""
    paged = PagedIndexInputs(inputs["q"], inputs["head_weights"], inputs["keys"], None, inputs["block_tables"],
                             inputs["visible"])  # fmt: skip
    return paged, inputs["k"]


def check_case(case: Case, device: torch.device | None = None) -> str | None:
    """Scores within fp32 rounding of the reference's (-inf exactly where it has -inf); the same choice."""
    import dsinfer.ops.indexer.triton as backend

    inputs = make_inputs(case)
    if device is not None:
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    got = backend.indexer_scores_launch(op_arguments(inputs)[0])
    gathered = inputs["keys"][inputs["block_tables"]].flatten(1, 2)
    expected = indexer_scores(inputs["q"], inputs["head_weights"], gathered)
    seen = torch.arange(expected.shape[1], device=expected.device) < inputs["visible"][:, None]
    expected = expected.masked_fill(~seen, float("-inf"))
    if not torch.equal(torch.isinf(got), torch.isinf(expected)):
        return f"{case}: -inf in other places"
    finite = torch.isfinite(expected)
    error = (got[finite] - expected[finite]).abs().max().item() if finite.any() else 0.0
    limit = 1e-5 * max(1.0, expected[finite].abs().max().item() if finite.any() else 1.0)
    if not error <= limit:
        return f"{case}: max |triton - reference| score = {error:.3g} > {limit:.3g}"
    chosen, real = backend.indexer_topk_decode_triton(*op_arguments(inputs))
    want_chosen, want_real = indexer_topk_decode_reference(*op_arguments(inputs))
    chosen, want_chosen = torch.where(real, chosen, -1), torch.where(want_real, want_chosen, -1)  # real ones only
    if not (torch.equal(chosen, want_chosen) and torch.equal(real, want_real)):
        return f"{case}: another choice\n{chosen}\n{want_chosen}\n{real}\n{want_real}"
    return None


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the kernel's bf16 dots, as the hardware computes them
    return [message for message in map(check_case, CASES) if message]


def test_triton_scores_match_reference_in_the_interpreter():
    """A fresh interpreter with TRITON_INTERPRET=1 set before Triton loads (tl.sum is a Triton function too)."""
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_indexer")


if torch.cuda.is_available():  # compiled kernels: collected where CUDA is (the interpreter test covers the CPU)

    @pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
    def test_triton_scores_match_reference_on_cuda(case):
        message = check_case(case, torch.device("cuda"))
        assert message is None, message


def test_reference_choice_is_in_position_order_with_padding_last():
    inputs = make_inputs(CASES[1])
    chosen, real = indexer_topk_decode_reference(*op_arguments(inputs))
    assert chosen.shape == real.shape == (4, 6)
    assert real.sum(dim=1).tolist() == [3, 6, 6, 6]
    for row, flags in zip(chosen, real, strict=True):
        picked = row[flags]
        assert torch.equal(picked, picked.sort().values) and bool((flags[: len(picked)]).all())


def test_registry_picks_reference_on_cpu():
    names = [b.name for b in registry.backends("indexer_topk_decode")]
    assert names[0] == "triton" and names[-1] == "reference"
    assert registry.choose("indexer_topk_decode", "cpu", torch.float32).name == "reference"


def test_triton_backend_falls_back_to_reference_when_the_kernel_fails(monkeypatch, caplog):
    import dsinfer.ops.indexer.triton as backend

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(backend, "indexer_scores_launch", broken)
    guarded = registry.falls_back_to_reference("indexer_topk_decode", "triton", backend.indexer_topk_decode_triton)
    inputs = make_inputs(CASES[1])
    with caplog.at_level("WARNING"):
        got = guarded(*op_arguments(inputs))
        again = guarded(*op_arguments(inputs))
    expected = indexer_topk_decode_reference(*op_arguments(inputs))
    assert all(torch.equal(a, b) for a, b in zip(got + again, expected + expected, strict=True))
    assert sum("the triton backend failed" in r.message for r in caplog.records) == 1


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def _compile_scores_kernel_for_hopper(pointers: dict, constants: dict):
    """The split-scores kernel compiled for sm_90 with ``constants``; (triton, the compiled kernel)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dsinfer.ops.index_scores_paged.triton as backend

    kernel = backend._split_scores_kernel
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*i64")
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    source = ASTSource(kernel, signature, constexprs=constants)
    return triton, triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=backend.NUM_WARPS))


def test_triton_scores_kernel_compiles_for_hopper():
    """sm_90 cubin at V4-Flash shapes (64 index heads x 128, 32 entries per block), no register spills."""
    pytest.importorskip("triton")
    import triton.language as tl

    import dsinfer.ops.index_scores_paged.triton as backend

    pointers = {"q_ptr": "*bf16", "weights_ptr": "*fp32", "keys_ptr": "*bf16", "scales_ptr": "*bf16",
                "scores_ptr": "*fp32"}  # fmt: skip
    constants = dict(PER_BLOCK=32, HEAD_DIM=128, SCALE_BLOCK=128, BLOCK_H=64, BLOCK_E=backend.BLOCK_E, FORM=0,
                     UE8M0=False, ROW_SCALE=False, DOT=tl.bfloat16, SPLIT_Q=False, PRECISION="tf32", BLOCK_D=128,
                     NUM_STAGES=backend.NUM_STAGES, FP4_HALVES=False)  # fmt: skip
    _assert_compiles_cleanly(pointers, constants, spills_checked=True)


def test_triton_fp4_halves_scores_kernel_compiles_for_hopper():
    """The FP4 even / odd halves layout (V4.1's coded index keys: 128 channels, a ue8m0 byte per 32, 64 entries per
    block) compiles to an sm_90 cubin without local memory."""
    pytest.importorskip("triton")
    import triton.language as tl

    import dsinfer.ops.index_scores_paged.triton as backend

    pointers = {"q_ptr": "*bf16", "weights_ptr": "*fp32", "keys_ptr": "*u8", "scales_ptr": "*u8",
                "scores_ptr": "*fp32"}  # fmt: skip
    constants = dict(PER_BLOCK=64, HEAD_DIM=128, SCALE_BLOCK=32, BLOCK_H=64, BLOCK_E=backend.BLOCK_E, FORM=2,
                     UE8M0=True, ROW_SCALE=False, DOT=tl.bfloat16, SPLIT_Q=False, PRECISION="tf32", BLOCK_D=128,
                     NUM_STAGES=backend.NUM_STAGES, FP4_HALVES=True)  # fmt: skip
    _assert_compiles_cleanly(pointers, constants, spills_checked=False)


def _assert_compiles_cleanly(pointers: dict, constants: dict, spills_checked: bool) -> None:
    """A cubin without local memory, within the H200's shared memory per block; no register spills when
    ``spills_checked`` (and a cuobjdump is there)."""
    _, compiled = _compile_scores_kernel_for_hopper(pointers, constants)
    assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"]
    assert compiled.metadata.shared <= 227 * 1024
    if spills_checked:  # register spills show as stack in the cubin's resource usage
        assert register_spills(compiled.asm["cubin"]) in (0, None)
