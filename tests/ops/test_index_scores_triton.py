"""index_scores / index_topk: the Triton kernels (in Triton's CPU interpreter; compiled on CUDA) against the
reference on random shapes with the edges (one query, W past a tile, nothing visible, everything visible, heads
past a chunk, both key layouts, mixed dtypes), exact ties on integer-valued inputs (the same top-k), the
fallbacks, and sm_90 builds of both kernels at V4-Flash shapes without register spills."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from hopper_build import compile_for_hopper, registers_and_stack
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.index_scores.reference import index_scores_reference, index_topk_reference


@dataclass(frozen=True)
class Case:
    queries: int
    width: int  # entries W
    visible: tuple[int, ...] | str = "random"  # per query, or "random" / "none" / "all"
    heads: int = 4
    dim: int = 32
    shared: bool = True  # keys [W, d]; else [n, W, d]
    q_dtype: torch.dtype = torch.float32
    key_dtype: torch.dtype = torch.float32
    config: tuple[int, int, int, int] | None = None  # (block_t, block_w, block_h, warps): else choose_config
    k: int = 8
    seed: int = 0


CASES = [
    Case(queries=1, width=37, visible=(37,)),  # one query, one partial tile
    Case(queries=70, width=150, heads=5, dim=48, q_dtype=torch.bfloat16, key_dtype=torch.bfloat16, seed=1),
    Case(queries=9, width=130, visible="none", seed=2),  # nothing visible: every score -inf
    Case(queries=33, width=70, visible="all", config=(16, 32, 0, 4), seed=3),  # every entry; tails of both axes
    Case(queries=20, width=45, heads=3, config=(16, 16, 0, 4), k=50, seed=4),  # k wider than W
    Case(queries=6, width=30, q_dtype=torch.bfloat16, seed=5),  # bf16 queries, fp32 keys: the IEEE path
    Case(queries=3, width=40, visible=(0, 40, 17), heads=20, shared=False, seed=6),  # 20 heads: chunks of 16
    Case(
        queries=4,
        width=33,
        heads=64,
        dim=128,
        shared=False,
        q_dtype=torch.bfloat16,
        key_dtype=torch.bfloat16,
        k=16,
        seed=7,
    ),  # V4-Flash heads, per-query keys  # fmt: skip
    Case(queries=5, width=20, heads=40, shared=False, config=(1, 16, 16, 4), seed=8),  # 3 chunks, last partial
    Case(queries=40, width=50, heads=6, dim=64, seed=9),  # fp32 d = 64: slices of d (the chosen 16)
    Case(queries=7, width=21, heads=3, dim=64, shared=False, q_dtype=torch.bfloat16, seed=10),  # sliced, mixed
]


def make_inputs(case: Case, integers: bool = False) -> tuple:
    """(q, keys, head_weights, visible); ``integers``: small integer q and keys, power-of-two weights, so every
    sum is exact in fp32 whatever its order and equal scores are truly equal (ReLU zeros and beyond)."""
    gen = torch.Generator().manual_seed(case.seed)
    key_shape = (case.width, case.dim) if case.shared else (case.queries, case.width, case.dim)
    if integers:
        q = torch.randint(-2, 3, (case.queries, case.heads, case.dim), generator=gen).float()
        keys = torch.randint(-2, 3, key_shape, generator=gen).float()
        choices = torch.tensor([0.5, 1.0, 2.0, -1.0])
        head_weights = choices[torch.randint(0, 4, (case.queries, case.heads), generator=gen)]
    else:
        q = torch.randn(case.queries, case.heads, case.dim, generator=gen)
        keys = torch.randn(*key_shape, generator=gen)
        head_weights = torch.randn(case.queries, case.heads, generator=gen) * case.heads**-0.5
    if case.visible == "none":
        visible = torch.zeros(case.queries, dtype=torch.long)
    elif case.visible == "all":
        visible = torch.full((case.queries,), case.width)
    elif case.visible == "random":
        visible = torch.randint(0, case.width + 1, (case.queries,), generator=gen)
        visible[0] = case.width  # every case with more than one query sees 0 .. W somewhere
        visible[-1] = 0 if case.queries > 1 else case.width
    else:
        visible = torch.tensor(case.visible)
    return q.to(case.q_dtype), keys.to(case.key_dtype), head_weights, visible


def launch_config(case: Case):
    import dsinfer.ops.index_scores.triton as backend

    if case.config is None:
        return None
    block_t, block_w, block_h, warps = case.config
    return backend.ScoresConfig(block_t, block_w, block_h, block_k=16, num_warps=warps, num_stages=2)


def check_scores(case: Case, device: torch.device | None) -> str | None:
    """-inf exactly where the reference has -inf; elsewhere within fp32 rounding of it."""
    import dsinfer.ops.index_scores.triton as backend

    inputs = tuple(t.to(device) for t in make_inputs(case)) if device is not None else make_inputs(case)
    got = backend.index_scores_launch(*inputs, config=launch_config(case))
    expected = index_scores_reference(*inputs)
    if got.shape != expected.shape or got.dtype != torch.float32:
        return f"{case}: {got.shape} {got.dtype} for {expected.shape} float32"
    if not torch.equal(torch.isinf(got), torch.isinf(expected)):
        return f"{case}: -inf in other places"
    finite = torch.isfinite(expected)
    if not finite.any():
        return None
    error = (got[finite] - expected[finite]).abs().max().item()
    limit = 1e-5 * max(1.0, expected[finite].abs().max().item())
    if not error <= limit:
        return f"{case}: max |triton - reference| score = {error:.3g} > {limit:.3g}"
    return None


def integer_case(case: Case) -> Case:
    """The case at d = 16 or 64: 1 / sqrt(d) a power of two, so scaling before or after the sum is exact too."""
    return replace(case, dim=16 if case.dim <= 32 else 64)


def check_ties(case: Case, device: torch.device | None) -> str | None:
    """On integer inputs the scores are equal bit for bit, ties abound, and the top-k is the reference's."""
    import dsinfer.ops.index_scores.triton as backend

    case = integer_case(case)
    inputs = make_inputs(case, integers=True)
    if device is not None:
        inputs = tuple(t.to(device) for t in inputs)
    got = backend.index_scores_launch(*inputs, config=launch_config(case))
    expected = index_scores_reference(*inputs)
    if not torch.equal(got, expected):
        return f"{case}: integer-valued scores differ by {(got - expected).abs().nan_to_num().max().item()}"
    chosen, real = backend.index_topk_triton(*inputs, case.k)
    want_chosen, want_real = index_topk_reference(*inputs, case.k)
    if not (torch.equal(chosen, want_chosen) and torch.equal(real, want_real)):
        return f"{case}: another top-k\n{chosen}\n{want_chosen}\n{real}\n{want_real}"
    return None


def run_interpreted_cases() -> list[str]:
    """Every case through the interpreter (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's bf16 dot multiplies raw bits: the shared repair
    messages = [check_scores(case, None) for case in CASES] + [check_ties(case, None) for case in CASES]
    return [message for message in messages if message]


def test_triton_scores_and_topk_match_reference_in_the_interpreter():
    """A fresh interpreter with TRITON_INTERPRET=1 set before Triton loads (tl.sum is a Triton function too)."""
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_index_scores_triton")


def test_integer_inputs_tie_at_zero_and_above_it():
    """The tie check is only worth something where the reference's choice does fall among equal scores."""
    boundary_ties = zero_ties = 0
    for case in CASES:
        if case.width <= case.k or case.visible == "none":
            continue
        scores = index_scores_reference(*make_inputs(integer_case(case), integers=True))
        ordered = scores.sort(dim=1, descending=True).values
        at_k, after = ordered[:, case.k - 1], ordered[:, case.k]
        tied = (at_k == after) & torch.isfinite(at_k)
        boundary_ties += int(tied.sum())
        zero_ties += int((tied & (at_k == 0)).sum())
    assert boundary_ties > zero_ties > 0


if torch.cuda.is_available():  # compiled kernels: collected where CUDA is (the interpreter test covers the CPU)

    @pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
    def test_triton_scores_match_reference_on_cuda(case):
        message = check_scores(case, torch.device("cuda")) or check_ties(case, torch.device("cuda"))
        assert message is None, message

    def test_registry_picks_triton_on_cuda():
        for op in ("index_scores", "index_topk"):
            assert registry.choose(op, "cuda", torch.bfloat16).name == "triton"


def test_registry_picks_reference_on_cpu():
    for op in ("index_scores", "index_topk"):
        names = [b.name for b in registry.backends(op)]
        assert names[0] == "triton" and names[-1] == "reference"
        assert registry.choose(op, "cpu", torch.float32).name == "reference"


def _refuse(*args, **kwargs):
    raise RuntimeError("no kernel for you")


def test_triton_backend_falls_back_to_reference_when_the_kernel_fails(monkeypatch, caplog):
    """A kernel that does not compile here is warned about once (by the registry's fallback, the only one) and
    the reference answers instead, for the scores and the choice built on them."""
    import dsinfer.ops.index_scores.triton as backend

    monkeypatch.setattr(backend, "index_scores_launch", _refuse)
    scores = registry.falls_back_to_reference("index_scores", "triton", backend.index_scores_triton)
    topk = registry.falls_back_to_reference("index_topk", "triton", backend.index_topk_triton)
    inputs = make_inputs(CASES[1])
    with caplog.at_level("WARNING"):
        got = scores(*inputs)
        again = scores(*inputs)
    chosen, real = topk(*inputs, 8)
    assert torch.equal(got, index_scores_reference(*inputs)) and torch.equal(again, got)
    want_chosen, want_real = index_topk_reference(*inputs, 8)
    assert torch.equal(chosen, want_chosen) and torch.equal(real, want_real)
    assert sum("index_scores: the triton backend failed" in r.message for r in caplog.records) == 1


def test_inputs_the_kernels_do_not_take_go_to_the_reference(monkeypatch):
    import dsinfer.ops.index_scores.triton as backend

    monkeypatch.setattr(backend, "index_scores_launch", _refuse)
    q, keys, head_weights, visible = make_inputs(CASES[3])
    strided_keys = torch.randn(keys.shape[1], keys.shape[0]).t()  # last axis not contiguous
    for args in [(q, strided_keys, head_weights, visible), (q, keys.double(), head_weights, visible)]:
        assert not backend.serves(*args)
        assert torch.equal(backend.index_scores_triton(*args), index_scores_reference(*args))
    assert backend.serves(q, keys, head_weights, visible)


ALIGNED_STRIDES = ("stride_qt", "stride_qh", "stride_kt", "stride_kw", "stride_wt", "stride_st")


TWO_PROGRAMS_A_MULTIPROCESSOR = 128  # registers a thread: two 8-warp programs share an sm_90 multiprocessor's 64 Ki
CAPPED_STACK_BYTES = 128  # the spill the capped launch may take where the compiler wants more than the cap


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("shared", [True, False], ids=["shared_keys", "per_query_keys"])
@pytest.mark.parametrize("dtypes", [("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32")], ids=str)
@pytest.mark.parametrize("capped", [False, True], ids=["chosen", "capped"])
def test_triton_scores_kernels_compile_for_hopper(shared, dtypes, capped):
    """sm_90 cubins at V4-Flash shapes (64 index heads x 128) with the chosen launches: no register spills.
    ``dtypes``: the queries' and the keys' (16-bit and the same: tensor cores; else IEEE fp32). ``capped``: the
    16-bit shared-keys launch at 128 registers a thread (``indexer_prefill.py --sweep`` times it): within the cap,
    spilling nothing with Triton 3.6 (124 registers) and at most a few values with 3.8 / 3.9 (80 bytes of stack)."""
    pytest.importorskip("triton")
    import dsinfer.ops.index_scores.triton as backend

    tensor_cores = dtypes == ("bf16", "bf16")
    if capped and not (shared and tensor_cores):
        pytest.skip("the register cap is timed for the 16-bit shared-keys launch only")
    config = backend.choose_config(shared, tensor_cores, 64)
    if capped:
        config = replace(config, max_registers=TWO_PROGRAMS_A_MULTIPROCESSOR)
    pointers = {"q_ptr": f"*{dtypes[0]}", "keys_ptr": f"*{dtypes[1]}", "weights_ptr": "*fp32", "visible_ptr": "*i64",
                "scores_ptr": "*fp32"}  # fmt: skip
    constants = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_K=128 if tensor_cores else config.block_k,
                     BLOCK_W=config.block_w, PRECISION="tf32" if tensor_cores else "ieee")  # fmt: skip
    if shared:
        kernel, constants["BLOCK_T"] = backend._shared_keys_kernel, config.block_t
    else:
        kernel, constants["BLOCK_H"] = backend._per_query_keys_kernel, config.block_h
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if config.max_registers:
        options["maxnreg"] = config.max_registers
    compiled = compile_for_hopper(kernel, pointers, constants, options, ALIGNED_STRIDES)
    assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"]
    assert compiled.metadata.shared <= 227 * 1024
    usage = registers_and_stack(compiled.asm["cubin"])
    if usage is not None:
        registers, stack = usage
        assert stack <= (CAPPED_STACK_BYTES if capped else 0), usage
        assert not capped or registers <= TWO_PROGRAMS_A_MULTIPROCESSOR, usage
