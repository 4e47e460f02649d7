"""sparse_attention_decode: the reference against the layer's former inline math (bit for bit), and the Triton
kernels (in Triton's CPU interpreter; compiled on CUDA) against the reference on random shapes and edge cases."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from hopper_build import register_spills
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.sparse_attention.reference import SparseDecodeInputs, StepRows, sparse_attention_decode_reference


@dataclass(frozen=True)
class Case:
    """One decode step: ``positions`` and ``window_from`` per sequence, a cache of ``window`` ring rows per slot
    and ``per_block`` entries per block; ``n_indices`` entry slots per sequence, ``invalid`` of them -1 (or all
    when ``invalid`` is 1.0); ``entries=False`` is a window-only layer."""

    positions: tuple[int, ...]
    window_from: tuple[int, ...] | None = None
    heads: int = 8
    dim: int = 64
    window: int = 16
    per_block: int = 4
    table_width: int = 5
    n_indices: int = 12
    invalid: float = 0.25
    entries: bool = True
    dtype: torch.dtype = torch.float32
    num_splits: int | None = None
    block_h: int = 16  # 0: the configuration choose_config picks
    block_n: int = 16
    seed: int = 0
    step: int = 0  # a verify step of this many rows a sequence, read from its own rows (the query's is among them)


CASES = [
    Case(positions=(0,), entries=False),  # one token, the first of its sequence: one visible key
    Case(positions=(0,), n_indices=4, invalid=1.0),  # zero selected compressed entries
    Case(positions=(5, 40), invalid=1.0, num_splits=3),  # zero entries, several splits (most see nothing)
    Case(positions=(9,), window_from=(4,)),  # window partly filled, the ring's start after a prefix hit
    Case(positions=(15, 16, 17, 31), n_indices=9),  # ring wrap-around at the window boundary; K + W tails a tile
    Case(positions=(3, 70, 129, 500, 12), window_from=(0, 60, 0, 490, 0), heads=20, seed=1),  # mixed; 20 % 16
    Case(positions=(33,), heads=4, dim=48, window=8, n_indices=5, per_block=2, seed=2),  # heads < group; D tail
    Case(positions=(100, 7), n_indices=20, num_splits=1, seed=3),  # one split: the program finishes the sink
    Case(positions=(100, 7), n_indices=20, num_splits=4, block_n=32, seed=3),  # window and entries share tiles
    Case(positions=(64, 2), window=32, entries=False, num_splits=2, seed=4),  # window-only layer, two splits
    Case(positions=(0,), entries=False, dtype=torch.bfloat16),
    Case(positions=(3, 70, 129, 500, 12), window_from=(0, 60, 0, 490, 0), heads=20, dtype=torch.bfloat16, seed=5),
    Case(positions=(100, 7, 55), n_indices=20, num_splits=2, block_n=32, dtype=torch.bfloat16, seed=6),
    Case(positions=(40,), n_indices=6, invalid=1.0, dtype=torch.bfloat16, seed=7),
    Case(positions=(300, 9, 77), heads=64, dim=32, n_indices=40, dtype=torch.bfloat16, block_h=0, seed=8),  # 64 x 1
    Case(positions=(300, 9), heads=20, dim=32, n_indices=40, block_h=32, block_n=32, seed=9),  # 20 of a 32 group
    Case(positions=(30, 2), heads=4, dim=8, window=4, per_block=2, n_indices=3, seed=10),  # D < 16: padded to 16
    # forced splits where the combine also splits the channels (choose_combine: blocks of 64 channels)
    Case(positions=(90,), heads=5, dim=200, n_indices=20, num_splits=3, seed=11),  # 4 blocks, the last masked
    Case(positions=(70, 300), heads=20, dim=256, n_indices=24, num_splits=5, block_n=32, dtype=torch.bfloat16),
    # a verify step's rows outside the ring (the ring as it was before the step): starting inside the window, at
    # its start, after a prefix hit, at position 0
    Case(positions=(15, 16, 17, 31, 2), window_from=(0, 3, 0, 0, 0), step=4, seed=14),
    Case(positions=(64, 3, 40), window=32, entries=False, num_splits=2, step=3, dtype=torch.bfloat16, seed=15),
]


def make_inputs(case: Case) -> dict:
    """Random tensors for ``case`` in the op's argument order (slots shuffled, block tables drawn at random)."""
    gen = torch.Generator().manual_seed(case.seed)
    batch = len(case.positions)
    slot_count, block_count = batch + 2, batch * case.table_width + 3
    window_from = case.window_from or (0,) * batch
    entries = torch.randn(block_count, case.per_block, case.dim, generator=gen).to(case.dtype)
    tables = torch.randperm(block_count, generator=gen)[: batch * case.table_width].view(batch, -1)
    indices = torch.randint(0, case.table_width * case.per_block, (batch, case.n_indices), generator=gen)
    drop = torch.rand(batch, case.n_indices, generator=gen) < case.invalid
    return {
        "q": torch.randn(batch, case.heads, case.dim, generator=gen).to(case.dtype),
        "window": torch.randn(slot_count, case.window, case.dim, generator=gen).to(case.dtype),
        "slots": torch.randperm(slot_count, generator=gen)[:batch],
        "positions": torch.tensor(case.positions),
        "window_from": torch.tensor(window_from),
        "entries": entries if case.entries else None,
        "block_tables": tables,
        "indices": torch.where(drop, -1, indices) if case.entries else None,
        "sink": torch.randn(case.heads, generator=gen),
        "softmax_scale": case.dim**-0.5,
        "step": _step_rows(case, gen) if case.step else None,
    }


def _step_rows(case: Case, gen: torch.Generator) -> StepRows:
    """``case.step`` rows a sequence; sequence ``b``'s query is row ``b % step`` of its step."""
    batch = len(case.positions)
    rows = torch.randn(batch * case.step, case.dim, generator=gen).to(case.dtype)
    starts = torch.tensor(case.positions) - torch.arange(batch) % case.step
    return StepRows(rows, starts, torch.arange(batch) * case.step)


def _tensors(inputs: dict, change) -> dict:
    """``inputs`` with ``change`` applied to every tensor, the step's included."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, StepRows):
            value = StepRows(change(value.rows), change(value.starts), change(value.first_rows))
        elif isinstance(value, torch.Tensor):
            value = change(value)
        out[key] = value
    return out


def _as_float(inputs: dict) -> dict:
    return _tensors(inputs, lambda t: t.float() if t.is_floating_point() else t)


def check_triton_case(case: Case, device: torch.device | None = None) -> str | None:
    """The Triton kernels on ``case`` against the reference; a message when they disagree, else None.

    fp32: only the summation order differs (and IEEE dots): |err| <= 2e-5. bf16: the reference rounds its
    logits and probabilities to bf16, the kernel its unnormalised probabilities; both are held to the fp32
    reference on the same bf16 inputs, the kernel within 1.5e-2 (outputs are O(1) mixes of N(0, 1) rows).
    """
    import dsinfer.ops.sparse_attention.triton as backend

    inputs = make_inputs(case)
    if device is not None:
        inputs = _tensors(inputs, lambda t: t.to(device))
    config = backend.DecodeConfig(block_h=case.block_h, block_n=case.block_n) if case.block_h else None
    got = backend.sparse_attention_decode_launch(
        SparseDecodeInputs(**inputs), config=config, num_splits=case.num_splits
    )
    if got.dtype != case.dtype or got.shape != inputs["q"].shape:
        return f"{case}: got {got.dtype} {tuple(got.shape)}"
    exact = sparse_attention_decode_reference(SparseDecodeInputs(**_as_float(inputs)))
    error = (got.float() - exact).abs().max().item()
    limit = 2e-5 if case.dtype == torch.float32 else 1.5e-2
    if not error <= limit:
        return f"{case}: max |triton - reference| = {error:.3g} > {limit}"
    return None


def _interpret_bf16_as_hardware() -> None:
    """Triton's interpreter keeps bf16 values as raw uint16 bits: its ``tl.dot`` multiplies the bits as integers
    and its float32 -> bf16 cast truncates. Widen bf16 dot operands to the float32 values they stand for and
    round the cast to nearest even, as the compiled kernels do (the same repair as tests/ops/test_moe.py)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    create_dot, cast_impl = builder.create_dot, getattr(builder, "cast_impl", None)

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return handle

    def bf16_dot(a, b, d, *options):
        return create_dot(widen(a), widen(b), d, *options)

    def rounding_cast(src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(src, dst_type)

    builder.create_dot = bf16_dot
    if cast_impl is not None:  # Triton versions without it convert some other way
        builder.cast_impl = rounding_cast


# The combine alone on random partials: (sequences, heads, head_dim, splits, output dtype, seed).
COMBINE_CASES = [
    (1, 64, 512, 8, torch.bfloat16, 0),  # V4-Flash at one sequence: 64 programs of 8 x 64
    (3, 5, 48, 4, torch.float32, 1),  # odd heads, a head_dim that is no power of two
    (2, 20, 200, 7, torch.bfloat16, 2),  # 20 % 16 heads; 200 = 3 x 64 + 8 channels
    (4, 1, 16, 2, torch.float32, 3),  # one head
]


def _random_partials(batch: int, heads: int, dim: int, splits: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Split kernel outputs as the combine reads them: (max, sum) in the exp2 domain, some splits empty."""
    gen = torch.Generator().manual_seed(seed)
    part_max = torch.randn(batch, splits, heads, generator=gen) * 4
    part_sum = torch.rand(batch, splits, heads, generator=gen) * 30 + 1
    part_out = torch.randn(batch, splits, heads, dim, generator=gen) * part_sum[..., None]
    empty = torch.rand(batch, splits, heads, generator=gen) < 0.2  # a split that saw no visible key
    part_max = torch.where(empty, -1.0e30, part_max)
    part_sum = torch.where(empty, 0.0, part_sum)
    part_out = torch.where(empty[..., None], 0.0, part_out)
    sink = torch.randn(heads, generator=gen)
    return part_out, part_max, part_sum, sink


def check_combine_blocks(batch: int, heads: int, dim: int, splits: int, dtype: torch.dtype, seed: int) -> str | None:
    """The combine launched as choose_combine picks and as other head x channel blocks, against one program
    per (sequence, 16 heads) over the whole padded row (the arrangement before channel blocks): bit for bit;
    that one against a float64 merge of the same partials to rounding."""
    import triton

    import dsinfer.ops.sparse_attention.triton as backend

    part_out, part_max, part_sum, sink = _random_partials(batch, heads, dim, splits, seed)

    def combined(launch):
        out = torch.full((batch, heads, dim), float("nan"), dtype=dtype)  # a channel left unwritten stays NaN
        backend.combine_splits(part_out, part_max, part_sum, sink, out, launch)
        return out

    whole_h = min(16, triton.next_power_of_2(heads))
    whole = backend.CombineLaunch(whole_h, triton.next_power_of_2(dim), (batch, triton.cdiv(heads, whole_h), 1))
    expected = combined(whole)
    launches = [backend.choose_combine(batch, heads, dim)]
    for block_h, block_d in ((whole_h, 16), (max(1, whole_h // 4), 32)):
        grid = (batch, triton.cdiv(heads, block_h), triton.cdiv(dim, block_d))
        launches.append(backend.CombineLaunch(block_h, block_d, grid))
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    shape = (batch, heads, dim, splits, dtype)
    for launch in launches:
        if not torch.equal(combined(launch).view(bits), expected.view(bits)):
            return f"combine {shape}: {launch} differs from {whole}"
    sink_log2 = sink.double()[None, :, None] * 1.4426950408889634
    top = torch.maximum(part_max.double().amax(1), sink_log2[..., 0])
    weights = torch.exp2(part_max.double() - top[:, None])
    total = (part_sum.double() * weights).sum(1) + torch.exp2(sink_log2[..., 0] - top)
    exact = (part_out.double() * weights[..., None]).sum(1) / total[..., None]
    error = (expected.double() - exact).abs().max().item()
    limit = 1e-5 if dtype == torch.float32 else 1.6e-2
    if not error <= limit:
        return f"combine {shape}: max |combine - float64 merge| = {error:.3g} > {limit}"
    return None


def run_interpreted_cases() -> list[str]:
    """Every case through the interpreter (TRITON_INTERPRET=1 must be set before Triton loads)."""
    _interpret_bf16_as_hardware()
    messages = list(map(check_triton_case, CASES)) + [check_combine_blocks(*case) for case in COMBINE_CASES]
    return [message for message in messages if message]


def test_triton_kernels_match_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_sparse_attention")


# V4-Flash shapes (64 heads x 512, window 128, top-k 512 of 32-entry blocks): too slow for the interpreter.
FLASH_CASES = [
    Case(positions=(5000,), heads=64, dim=512, window=128, per_block=32, table_width=40, n_indices=512,
         invalid=0.1, dtype=torch.bfloat16, block_h=0),
    Case(positions=tuple(range(3, 3000, 97)), heads=64, dim=512, window=128, per_block=32, table_width=24,
         n_indices=512, invalid=0.5, dtype=torch.bfloat16, block_h=0, seed=1),
    Case(positions=(60, 4000, 130), heads=64, dim=512, window=128, per_block=1, table_width=40, n_indices=40,
         dtype=torch.float32, block_h=0, seed=2),
]  # fmt: skip

if torch.cuda.is_available():  # compiled kernels: collected where CUDA is (the interpreter test covers the CPU)

    @pytest.mark.parametrize("case", CASES + FLASH_CASES, ids=range(len(CASES) + len(FLASH_CASES)))
    def test_triton_kernels_match_reference_on_cuda(case):
        message = check_triton_case(case, torch.device("cuda"))
        assert message is None, message

    def test_triton_decode_replays_in_a_cuda_graph():
        """Captured once, replayed after the step's tensors change in place (positions, slots, indices)."""
        import dsinfer.ops.sparse_attention.triton as backend

        case = FLASH_CASES[1]
        inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_inputs(case).items()}
        backend.sparse_attention_decode_triton(SparseDecodeInputs(*inputs.values()))  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.sparse_attention_decode_triton(SparseDecodeInputs(*inputs.values()))
        fresh = make_inputs(Case(**{**case.__dict__, "seed": 9}))
        for name in ("q", "slots", "positions", "window_from", "indices"):
            inputs[name].copy_(fresh[name])
        graph.replay()
        exact = sparse_attention_decode_reference(SparseDecodeInputs(**_as_float(inputs)))
        assert (out.float() - exact).abs().max().item() <= 1.5e-2


def _inline_decode_math(inputs: dict, chosen: torch.Tensor | None, real: torch.Tensor | None) -> torch.Tensor:
    """The V4 layer's decode attention as it was written inline before the op (kept literally as the oracle):
    every block-table slot's entries gathered, then the chosen ones (CSA) or all of them (HCA), masked by real."""
    q, ring, slots, positions = inputs["q"], inputs["window"], inputs["slots"], inputs["positions"]
    size = ring.shape[1]
    key_positions = positions[:, None] - size + 1 + torch.arange(size)
    keys = ring[slots[:, None], key_positions.remainder(size)].to(q.dtype)
    visible = (key_positions >= 0) & (key_positions >= inputs["window_from"][:, None])
    if chosen is not None:
        entries = inputs["entries"][inputs["block_tables"]].flatten(1, 2)
        entries = entries.gather(1, chosen[..., None].expand(-1, -1, entries.shape[-1]))
        keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
        visible = torch.cat([visible, real], dim=1)
    logits = torch.einsum("bhd,bkd->bhk", q, keys).float() * inputs["softmax_scale"]
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sink = inputs["sink"].float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bhk,bkd->bhd", probs.to(keys.dtype), keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", ["window", "csa", "hca"])
def test_reference_is_the_former_inline_math_bit_for_bit(dtype, layer):
    """The reference equals the layer's former decode math exactly: invalid entries become -1 indices, which
    read some other entry that the mask then zeroes, as the unchosen or unfinished slots were before."""
    case = Case(positions=(3, 70, 129, 500, 12), window_from=(0, 60, 0, 490, 0), dtype=dtype, entries=True)
    inputs = make_inputs(case)
    gen = torch.Generator().manual_seed(11)
    slots_per_table = case.table_width * case.per_block
    if layer == "window":
        chosen = real = None
        inputs.update(entries=None, indices=None)
    elif layer == "csa":  # the indexer's choice: some chosen slots are not real (fewer visible than top-k)
        chosen = torch.randint(0, slots_per_table, (5, 7), generator=gen)
        real = torch.rand(5, 7, generator=gen) < 0.7
    else:  # every slot of the table, the first `count` visible
        chosen = torch.arange(slots_per_table).expand(5, -1)
        real = chosen < torch.tensor([0, 3, 7, 20, 1])[:, None]
    if chosen is not None:
        inputs["indices"] = torch.where(real, chosen, -1)
    assert torch.equal(
        sparse_attention_decode_reference(SparseDecodeInputs(**inputs)), _inline_decode_math(inputs, chosen, real)
    )


def test_step_rows_read_beside_the_ring_are_the_ring_with_them_written_bit_for_bit():
    """A verify step's rows read from ``step`` while the ring holds the window before the step give what the ring
    with those rows written at their positions gives (the keys' values and order are the same)."""
    case = Case(positions=(15, 16, 17, 31, 2), window_from=(0, 3, 0, 0, 0), step=4, seed=14)
    inputs = make_inputs(case)
    step, window = inputs["step"], inputs["window"].clone()
    for b, slot in enumerate(inputs["slots"].tolist()):
        for j in range(case.step):
            position = int(step.starts[b]) + j
            if position <= case.positions[b]:  # the rows a query of the step sees (its own and the ones before)
                window[slot, position % case.window] = step.rows[int(step.first_rows[b]) + j]
    expected = sparse_attention_decode_reference(SparseDecodeInputs(**{**inputs, "window": window, "step": None}))
    assert torch.equal(sparse_attention_decode_reference(SparseDecodeInputs(**inputs)), expected)


def test_registry_picks_reference_on_cpu_and_triton_on_cuda():
    names = [b.name for b in registry.backends("sparse_attention_decode")]
    assert names[0] == "triton" and names[-1] == "reference"
    assert registry.choose("sparse_attention_decode", "cpu", torch.float32).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose("sparse_attention_decode", "cuda", torch.bfloat16).name == "triton"


def test_triton_backend_falls_back_to_reference_when_the_kernel_fails(monkeypatch, caplog):
    """A kernel that does not compile here is warned about once (by the registry's fallback, the only one) and
    the reference answers instead."""
    import dsinfer.ops.sparse_attention.triton as backend

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(backend, "sparse_attention_decode_launch", broken)
    # the op table's function: the registry's guard around the backend
    guarded = registry.falls_back_to_reference(
        "sparse_attention_decode", "triton", backend.sparse_attention_decode_triton
    )
    inputs = make_inputs(Case(positions=(9, 30)))
    with caplog.at_level("WARNING"):
        got = guarded(SparseDecodeInputs(*inputs.values()))
        again = guarded(SparseDecodeInputs(*inputs.values()))
    expected = sparse_attention_decode_reference(SparseDecodeInputs(**inputs))
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert sum("the triton backend failed" in r.message for r in caplog.records) == 1


def test_split_count_depends_on_shapes_only():
    import dsinfer.ops.sparse_attention.triton as backend

    # V4-Flash CSA decode: 128 window rows + 512 entries = 20 tiles of 32; two programs per SM, a split per tile
    # at most.
    assert backend.choose_splits(batch=1, head_groups=1, n_tiles=20, sm_count=132) == 20
    assert backend.choose_splits(batch=32, head_groups=2, n_tiles=20, sm_count=132) == 5
    assert backend.choose_splits(batch=256, head_groups=1, n_tiles=20, sm_count=132) == 2
    assert backend.choose_splits(batch=512, head_groups=1, n_tiles=20, sm_count=132) == 1
    assert backend.choose_splits(batch=100, head_groups=1, n_tiles=20, sm_count=132) == 3
    assert backend.choose_splits(batch=1, head_groups=1, n_tiles=7, sm_count=132) == 7


def test_combine_splits_the_channels_of_a_small_step():
    import dsinfer.ops.sparse_attention.triton as backend

    def programs(launch) -> int:
        return launch.grid[0] * launch.grid[1] * launch.grid[2]

    one, some, many = (backend.choose_combine(batch, 64, 512) for batch in (1, 32, 256))
    assert (one.block_h, one.block_d, one.grid) == (8, 64, (1, 8, 8))
    assert (some.block_h, some.block_d, programs(some)) == (16, 256, 256)
    assert (many.block_h, many.block_d, programs(many)) == (16, 512, 1024)
    for batch, heads, dim in ((1, 5, 48), (2, 20, 200), (3, 64, 512), (1, 1, 8), (600, 128, 512)):
        launch = backend.choose_combine(batch, heads, dim)  # every (head, channel) in exactly one program
        assert launch.grid == (batch, -(-heads // launch.block_h), -(-dim // launch.block_d))
        assert launch.block_d <= max(64, dim) and launch.block_d & (launch.block_d - 1) == 0
        assert (launch.grid[1] - 1) * launch.block_h < heads and (launch.grid[2] - 1) * launch.block_d < dim


def test_a_small_step_takes_sixteen_heads_a_program():
    import dsinfer.ops.sparse_attention.triton as backend

    assert backend.choose_config(64, torch.bfloat16, 512, batch=1).block_h == 16
    assert backend.choose_config(64, torch.bfloat16, 512, batch=2).block_h == 16
    assert backend.choose_config(64, torch.bfloat16, 512, batch=32).block_h == 32
    assert backend.choose_config(64, torch.bfloat16, 512).block_h == 32


def _signature(kernel, activation: str) -> dict[str, str]:
    """Triton types of a kernel's runtime arguments, by the naming convention of the sparse_attention kernels."""
    float_pointers = {"q_ptr": activation, "window_ptr": activation, "entries_ptr": activation,
                      "step_ptr": activation, "out_ptr": activation}  # fmt: skip
    types = {}
    for name in kernel.arg_names:
        if name.isupper():
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = "*" + float_pointers.get(name, "fp32" if "part" in name or "sink" in name else "i64")
        else:
            types[name] = "fp32" if name == "scale_log2" else "i32"
    return types


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_triton_kernels_compile_for_hopper():
    """The interpreter never compiles; this builds the kernels to sm_90 cubins with Triton's bundled ptxas (no GPU
    needed) at V4-Flash shapes (64 heads x 512, window 128, top-k 512) in the configurations choose_config picks
    for bf16 and fp32: within the H200's 227 KiB of shared memory per block and without register spills."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dsinfer.ops.sparse_attention.triton as backend

    target = GPUTarget("cuda", 90, 32)
    # Triton before 3.9 compiles the fp32 (ieee) split kernel with 8 bytes of stack that 3.9 keeps in registers:
    # the compiler's scheduling, not our tile choice, differs; fp32 is the fallback for fp32 models, the bf16 path
    # (what checkpoints run) must fit on every version.
    older_triton = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9)
    for dtype, activation, precision, batch, has_step in (  # plain decode steps and verify steps (step rows)
        (torch.bfloat16, "bf16", "tf32", None, False),
        (torch.bfloat16, "bf16", "tf32", None, True),
        (torch.bfloat16, "bf16", "tf32", 1, True),
        (torch.float32, "fp32", "ieee", None, True),
    ):
        config = backend.choose_config(64, dtype, 512, batch)
        constants = dict(WINDOW=128, WINDOW_TILES=128 // config.block_n, PER_BLOCK=32, HEAD_DIM=512,
                         BLOCK_D=512, BLOCK_H=config.block_h, BLOCK_N=config.block_n, SPLITS=4, HAS_ENTRIES=True,
                         HAS_STEP=has_step, PRECISION=precision)  # fmt: skip
        kernel = backend._decode_split_kernel
        source = ASTSource(kernel, _signature(kernel, activation), constexprs=constants)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        compiled = triton.compile(source, target=target, options=options)
        assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"], activation
        assert compiled.metadata.shared <= 227 * 1024, (activation, compiled.metadata.shared)
        allowed_stack = 8 if activation == "fp32" and older_triton else 0
        assert (register_spills(compiled.asm["cubin"]) or 0) <= allowed_stack, activation
    kernel = backend._decode_combine_kernel
    for batch in (1, 32, 256):  # the blocks choose_combine picks for 64 heads x 512
        launch = backend.choose_combine(batch, 64, 512)
        constants = dict(HEAD_DIM=512, BLOCK_D=launch.block_d, BLOCK_H=launch.block_h, SPLITS=20)
        source = ASTSource(kernel, _signature(kernel, "bf16"), constexprs=constants)
        compiled = triton.compile(source, target=target, options=dict(num_warps=4))
        assert compiled.asm["cubin"] and register_spills(compiled.asm["cubin"]) in (0, None), launch


# The tiny V4 model's decode step with both decode ops on their Triton backends (interpreted) against the same
# step on the references, from one cache: the layer <-> op contract (ring, entry pool, block tables with the
# trash block, the indexer's -1 padding) on real model tensors. Sequences: mid-window, at a block edge, before
# any compressed entry, past the first HCA entry.
_TINY_DECODE = """
import copy
import torch
from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v4 import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.models.tiny import build_random_model, tiny_config
from dsinfer.ops import registry
import dsinfer.ops.indexer.triton as indexer
import dsinfer.ops.sparse_attention.triton as attention

model = build_random_model(tiny_config(), seed=1)
reference = registry.resolve("cpu", torch.float32)
fast = registry.OpTable(reference.device, reference.dtype, dict(reference.chosen))
for op, fn in (("sparse_attention_decode", attention.sparse_attention_decode_launch),
               ("indexer_topk_decode", indexer.indexer_topk_decode_triton)):
    fast.chosen[op] = registry.Backend(op, "triton", fn, ("cpu",), None, lambda: True, 10)
cfg = model.config
cache = KVCache(cfg, attention_layer_ratios(cfg, True), 4, 16, block_tokens_for(cfg), torch.float32, "cpu")
generator = torch.Generator().manual_seed(3)
lengths, tables = [37, 64, 3, 95], [[5, 1], [9, 2, 14], [0], [3, 11, 7, 12]]
with torch.no_grad():
    for slot, n in enumerate(lengths):
        prompt = torch.randint(3, 500, (n,), generator=generator)
        model(PackedBatch(prompt, torch.arange(n), [SequenceSpan(0, n, slot, tables[slot])], cache))
    spans = [SequenceSpan(n, 1, slot, tables[slot]) for slot, n in enumerate(lengths)]
    tokens, positions = torch.randint(3, 500, (4,), generator=generator), torch.tensor(lengths)
    reference_cache = copy.deepcopy(cache)
    model.use_ops(reference)
    expected = model(PackedBatch(tokens, positions, spans, reference_cache))
    model.use_ops(fast)
    got = model(PackedBatch(tokens, positions, spans, cache))
error = (got - expected).abs().max().item()
print("ok" if error <= 1e-4 and torch.equal(got.argmax(-1), expected.argmax(-1)) else f"logits differ by {error}")
"""


def test_tiny_model_decode_step_with_the_triton_ops_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", _TINY_DECODE], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "ok", result.stdout[-3000:]
