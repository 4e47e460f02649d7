"""sparse_attention_prefill: the reference against a per-token oracle written from the op's definition, and the
Triton kernel (in Triton's CPU interpreter; compiled on CUDA) against the reference on edge cases."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hopper_build import register_spills
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.sparse_attention import prefill_reference
from dsinfer.ops.sparse_attention.prefill_reference import SparsePrefillInputs, sparse_attention_prefill_reference


@dataclass(frozen=True)
class Case:
    """One prefill or mixed step: per sequence (start position, new tokens, window_from). ``layer`` is "window",
    "csa" (``topk`` random visible entries per token, ascending, -1 after them; ``holes`` of them turned into -1
    in place) or "hca" (every visible entry); ``ring`` rows per slot (0: the window's size)."""

    sequences: tuple[tuple[int, int, int], ...]
    layer: str = "csa"
    heads: int = 8
    dim: int = 32
    window: int = 16
    ring: int = 0
    ratio: int = 4
    per_block: int = 4
    topk: int = 6
    holes: float = 0.0
    dtype: torch.dtype = torch.float32
    block_h: int = 16  # 0: the configuration choose_config picks
    block_n: int = 16
    seed: int = 0


CASES = [
    Case(sequences=((0, 1, 0),), layer="window"),  # one token, the first of its sequence: one visible key
    Case(sequences=((37, 20, 0),)),  # a chunk starting mid-sequence: ring rows, then the new ones
    Case(sequences=((16, 16, 0), (15, 3, 0)), layer="window"),  # chunks at and one before the window boundary
    Case(sequences=((0, 10, 0),), layer="hca", ratio=32),  # HCA with zero visible entries
    Case(sequences=((3, 2, 0), (0, 3, 0)), topk=4),  # CSA with zero visible entries (all indices -1)
    Case(sequences=((20, 13, 0), (60, 5, 0)), holes=0.4, seed=1),  # -1 padding inside the chosen entries too
    Case(sequences=((0, 7, 0), (13, 5, 0), (40, 1, 0), (3, 11, 0)), layer="hca", ratio=4, seed=2),  # odd lengths
    Case(sequences=((50, 9, 45), (70, 4, 62)), seed=3),  # prefix hits: the ring holds positions from window_from
    Case(sequences=((33, 6, 0), (5, 9, 0)), ring=24, seed=4),  # a ring larger than the window (speculation)
    Case(sequences=((30, 17, 0), (2, 5, 0)), heads=20, dim=48, block_n=32, topk=9, seed=5),  # head / dim tails
    Case(sequences=((9, 4, 0),), heads=4, dim=8, window=4, per_block=2, topk=3, seed=6),  # D < 16: padded to 16
    Case(sequences=((0, 12, 0), (100, 3, 95)), layer="hca", dtype=torch.bfloat16, seed=7),
    Case(sequences=((37, 20, 30), (4, 7, 0)), holes=0.2, dtype=torch.bfloat16, seed=8),
    Case(sequences=((19, 9, 0), (0, 2, 0)), heads=64, dim=32, dtype=torch.bfloat16, block_h=0, seed=9),  # 64 x 1
    # the wide-head launch choose_prefill_config picks (64 heads a program, 64-key tiles): HCA entries, then CSA
    Case(sequences=((250, 3, 0), (0, 2, 0)), layer="hca", ratio=32, heads=64, dim=256, window=80,
         dtype=torch.bfloat16, block_h=0, seed=10),
    Case(sequences=((90, 2, 0),), heads=64, dim=256, window=70, topk=24, holes=0.2, dtype=torch.bfloat16, block_h=0,
         seed=11),
]  # fmt: skip


def make_inputs(case: Case) -> dict:
    """Random tensors for ``case`` in the op's argument order (slots shuffled, block tables drawn at random)."""
    gen = torch.Generator().manual_seed(case.seed)
    batch = len(case.sequences)
    ring = case.ring or case.window
    lengths = [length for _, length, _ in case.sequences]
    tokens = sum(lengths)
    positions = torch.cat([torch.arange(start, start + length) for start, length, _ in case.sequences])
    counts = [(start + length) // case.ratio for start, length, _ in case.sequences]
    width = max(1, max(math.ceil(count / case.per_block) for count in counts))
    block_count = batch * width + 1
    tables = torch.randperm(block_count, generator=gen)[: batch * width].view(batch, width)
    indices = None
    if case.layer == "csa":
        indices = torch.full((tokens, case.topk), -1, dtype=torch.long)
        for row, position in enumerate(positions.tolist()):
            visible = (position + 1) // case.ratio
            chosen = torch.randperm(visible, generator=gen)[: case.topk].sort().values
            indices[row, : chosen.numel()] = chosen
        holes = torch.rand(indices.shape, generator=gen) < case.holes
        indices = indices.masked_fill(holes, -1)
    return {
        "q": torch.randn(tokens, case.heads, case.dim, generator=gen).to(case.dtype),
        "kv": torch.randn(tokens, case.dim, generator=gen).to(case.dtype),
        "positions": positions,
        "sequence_rows": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        "starts": torch.tensor([start for start, _, _ in case.sequences]),
        "slots": torch.randperm(batch + 2, generator=gen)[:batch],
        "window_from": torch.tensor([window_from for _, _, window_from in case.sequences]),
        "window": torch.randn(batch + 2, ring, case.dim, generator=gen).to(case.dtype),
        "window_size": case.window,
        "entries": None
        if case.layer == "window"
        else torch.randn(block_count, case.per_block, case.dim, generator=gen).to(case.dtype),
        "block_tables": tables,
        "indices": indices,
        "compress_ratio": 0 if case.layer == "window" else case.ratio,
        "sink": torch.randn(case.heads, generator=gen),
        "softmax_scale": case.dim**-0.5,
        "spans": list(case.sequences),
    }


def per_token_oracle(inputs: dict) -> torch.Tensor:
    """The op's definition, one token at a time in float32: list the keys it sees, softmax with the sink."""
    q, kv, ring, entries = inputs["q"].float(), inputs["kv"].float(), inputs["window"].float(), inputs["entries"]
    rows, window_size, ratio = inputs["sequence_rows"].tolist(), inputs["window_size"], inputs["compress_ratio"]
    out = torch.zeros_like(q)
    for seq in range(len(rows) - 1):
        start, slot = int(inputs["starts"][seq]), int(inputs["slots"][seq])
        window_from, table = int(inputs["window_from"][seq]), inputs["block_tables"][seq]
        for row in range(rows[seq], rows[seq + 1]):
            position = int(inputs["positions"][row])
            keys = []
            for key_position in range(max(0, position - window_size + 1), position + 1):
                if key_position >= start:
                    keys.append(kv[rows[seq] + key_position - start])
                elif key_position >= window_from:
                    keys.append(ring[slot, key_position % ring.shape[1]])
            if entries is not None:
                if inputs["indices"] is not None:
                    chosen = [i for i in inputs["indices"][row].tolist() if i >= 0]
                else:
                    chosen = range((position + 1) // ratio)
                per_block = entries.shape[1]
                keys += [entries[table[i // per_block], i % per_block].float() for i in chosen]
            keys = torch.stack(keys)
            logits = torch.cat([q[row] @ keys.T * inputs["softmax_scale"], inputs["sink"].float()[:, None]], dim=1)
            out[row] = logits.softmax(dim=1)[:, :-1] @ keys
    return out


def _as_float(inputs: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.float32], ids=str)
def test_reference_is_the_per_token_definition(case):
    inputs = make_inputs(case)
    got = sparse_attention_prefill_reference(SparsePrefillInputs(**inputs))
    assert got.shape == inputs["q"].shape and got.dtype == inputs["q"].dtype
    torch.testing.assert_close(got, per_token_oracle(inputs), rtol=1e-5, atol=1e-5)


def test_reference_in_query_blocks_is_exact(monkeypatch):
    """Blocks of queries (each against the window keys it can see) give the same result as one block."""
    inputs = make_inputs(Case(sequences=((5, 40, 0), (90, 33, 80)), seed=11))
    whole = sparse_attention_prefill_reference(SparsePrefillInputs(**inputs))
    monkeypatch.setattr(prefill_reference, "QUERY_CHUNK", 7)  # blocks starting mid-window
    torch.testing.assert_close(
        sparse_attention_prefill_reference(SparsePrefillInputs(**inputs)), whole, rtol=1e-6, atol=1e-6
    )


def check_triton_case(case: Case, device: torch.device | None = None) -> str | None:
    """The Triton kernel on ``case`` against the reference in fp32 on the same inputs; a message when they
    disagree. fp32: |err| <= 2e-5 (summation order, IEEE dots); bf16: |err| <= 1.5e-2 + 1e-2 |exact| (the
    decode tests' bound, widened by the output's own rounding: half a bf16 step is 1.6e-2 at 4.0)."""
    import dsinfer.ops.sparse_attention.prefill_triton as backend
    import dsinfer.ops.sparse_attention.triton as decode_backend

    inputs = make_inputs(case)
    if device is not None:
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    config = decode_backend.DecodeConfig(block_h=case.block_h, block_n=case.block_n) if case.block_h else None
    got = backend.sparse_attention_prefill_launch(SparsePrefillInputs(**inputs), config=config)
    if got.dtype != case.dtype or got.shape != inputs["q"].shape:
        return f"{case}: got {got.dtype} {tuple(got.shape)}"
    exact = sparse_attention_prefill_reference(SparsePrefillInputs(**_as_float(inputs)))
    error = (got.float() - exact).abs()
    limit = torch.full_like(exact, 2e-5) if case.dtype == torch.float32 else 1.5e-2 + 1e-2 * exact.abs()
    if not (error <= limit).all():
        worst = int((error - limit).flatten().argmax())
        return (
            f"{case}: |triton - reference| = {error.flatten()[worst]:.3g} > {limit.flatten()[worst]:.3g} "
            f"where the reference is {exact.flatten()[worst]:.3g}"
        )
    return None


def run_interpreted_cases() -> list[str]:
    """Every case through the interpreter (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()
    return [message for message in map(check_triton_case, CASES) if message]


def test_triton_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_sparse_attention_prefill")


def test_registry_picks_reference_on_cpu_and_triton_on_cuda():
    names = [b.name for b in registry.backends("sparse_attention_prefill")]
    assert names[0] == "triton" and names[-1] == "reference"
    assert registry.choose("sparse_attention_prefill", "cpu", torch.float32).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose("sparse_attention_prefill", "cuda", torch.bfloat16).name == "triton"


def test_triton_backend_falls_back_to_reference_when_the_kernel_fails(monkeypatch, caplog):
    """A kernel that does not compile here is warned about once (by the registry's fallback, the only one) and
    the reference answers instead."""
    import dsinfer.ops.sparse_attention.prefill_triton as backend

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(backend, "sparse_attention_prefill_launch", broken)
    # the op table's function: the registry's guard around the backend
    guarded = registry.falls_back_to_reference(
        "sparse_attention_prefill", "triton", backend.sparse_attention_prefill_triton
    )
    inputs = make_inputs(CASES[1])
    with caplog.at_level("WARNING"):
        got = guarded(SparsePrefillInputs(*inputs.values()))
        again = guarded(SparsePrefillInputs(*inputs.values()))
    expected = sparse_attention_prefill_reference(SparsePrefillInputs(**inputs))
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert sum("the triton backend failed" in r.message for r in caplog.records) == 1


# V4-Flash shapes (64 heads x 512, window 128, top-k 512, CSA ratio 4 / HCA ratio 128): too slow for the interpreter.
FLASH_CASES = [
    Case(sequences=((0, 700, 0), (1000, 300, 0), (5, 1, 0)), heads=64, dim=512, window=128, ratio=4,
         per_block=32, topk=512, dtype=torch.bfloat16, block_h=0),
    Case(sequences=((0, 600, 0), (3000, 129, 2990)), layer="hca", heads=64, dim=512, window=128, ratio=128,
         per_block=1, dtype=torch.bfloat16, block_h=0, seed=1),
    Case(sequences=((200, 300, 150),), heads=64, dim=512, window=128, ratio=4, per_block=32, topk=512,
         holes=0.3, dtype=torch.float32, block_h=0, seed=2),
]  # fmt: skip

if torch.cuda.is_available():  # compiled kernels: collected where CUDA is (the interpreter test covers the CPU)

    @pytest.mark.parametrize("case", CASES + FLASH_CASES, ids=range(len(CASES) + len(FLASH_CASES)))
    def test_triton_kernel_matches_reference_on_cuda(case):
        message = check_triton_case(case, torch.device("cuda"))
        assert message is None, message


def _signature(kernel, activation: str) -> dict[str, str]:
    """Triton types of the prefill kernel's runtime arguments: activations, the fp32 sink, int64 metadata."""
    activations = {"q_ptr", "kv_ptr", "window_ptr", "entries_ptr", "out_ptr"}
    types = {}
    for name in kernel.arg_names:
        if name.isupper():
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = "*" + (activation if name in activations else "fp32" if name == "sink_ptr" else "i64")
        else:
            types[name] = "fp32" if name == "scale_log2" else "i32"
    return types


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("layer", ["csa", "hca"])
def test_triton_kernel_compiles_for_hopper(layer):
    """The interpreter never compiles; this builds the kernel to sm_90 cubins with Triton's bundled ptxas (no GPU
    needed) at V4-Flash shapes (64 heads x 512, window 128; CSA ratio 4 with 32 entries per block, HCA 128 with
    one) in the configurations choose_prefill_config picks for bf16 and fp32: within the H200's 227 KiB of shared
    memory per block; fp32 without register spills, bf16 (64 heads a program, 64-key tiles: the warpgroup MMA,
    measured 2.3-2.6x faster than the spill-free 32 x 32 launch on the H100) within 3 KiB a thread of spills."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dsinfer.ops.sparse_attention.prefill_triton as backend

    target = GPUTarget("cuda", 90, 32)
    ratio, per_block, mode = (4, 32, backend.CHOSEN_ENTRIES) if layer == "csa" else (128, 1, backend.VISIBLE_ENTRIES)
    for dtype, activation, precision in ((torch.bfloat16, "bf16", "tf32"), (torch.float32, "fp32", "ieee")):
        config = backend.choose_prefill_config(64, dtype, 512)
        constants = dict(WINDOW=128, RING=128, WINDOW_TILES=128 // config.block_n, PER_BLOCK=per_block, RATIO=ratio,
                         HEAD_DIM=512, BLOCK_D=512, BLOCK_H=config.block_h, BLOCK_N=config.block_n, ENTRIES=mode,
                         PRECISION=precision)  # fmt: skip
        kernel = backend._prefill_kernel
        source = ASTSource(kernel, _signature(kernel, activation), constexprs=constants)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        compiled = triton.compile(source, target=target, options=options)
        assert compiled.asm["cubin"], activation
        assert compiled.metadata.shared <= 227 * 1024, (activation, compiled.metadata.shared)
        spills = register_spills(compiled.asm["cubin"]) or 0
        if dtype == torch.float32:
            assert spills == 0 and "ld.local" not in compiled.asm["ptx"], activation
        else:
            assert "wgmma" in compiled.asm["ptx"] and spills <= 3 * 1024, (activation, spills)


def test_the_prefill_launch_by_heads_dtype_and_gpu():
    """Wide bf16 heads take 64 heads a program and 64-key tiles (Hopper's warpgroup MMA), 32-63 heads 32 x 32 at 4
    warps; fp32, narrow heads and GPUs before Hopper keep the decode kernel's launch."""
    from dsinfer.ops.sparse_attention.prefill_triton import choose_prefill_config
    from dsinfer.ops.sparse_attention.triton import DecodeConfig, choose_config

    assert choose_prefill_config(64, torch.bfloat16, 512) == DecodeConfig(64, 64, 8, 2)
    assert choose_prefill_config(48, torch.float16, 512) == DecodeConfig(32, 32, 4, 2)
    for heads, dtype, dim, hopper in ((64, torch.float32, 512, True), (64, torch.bfloat16, 128, True),
                                      (64, torch.bfloat16, 512, False), (16, torch.bfloat16, 512, True)):  # fmt: skip
        assert choose_prefill_config(heads, dtype, dim, warpgroup_mma=hopper) == choose_config(heads, dtype, dim)
