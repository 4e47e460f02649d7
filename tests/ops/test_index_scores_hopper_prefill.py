"""The prefill index scores' Gluon kernel for Hopper (``dsinfer/ops/index_scores/hopper.py``): on an sm_90 GPU
against the torch reference (-inf in the same places, finite scores within fp32 rounding) and for the same top-k on
untied scores, at V4's and V4.1's head counts, bf16 and fp16, query and entry tails, causal and ragged views, and
every pipeline depth; on the CPU, its sm_90 build: the MMA asynchronous, one in flight while the previous head sums
(the compiler keeps them overlapped: a wait for one outstanding MMA, not for none after each)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_index_scores_triton import Case, make_inputs

from dsinfer.ops.index_scores.reference import index_scores_reference, top_k_in_order

GLUON = "gluon"
CASES = [
    Case(queries=200, width=1000, heads=64, dim=128, q_dtype=torch.bfloat16, key_dtype=torch.bfloat16, seed=21),
    Case(queries=64, width=128, visible="all", heads=32, dim=128, q_dtype=torch.bfloat16, key_dtype=torch.bfloat16,
         seed=22),  # V4.1's heads, one whole tile
    Case(queries=70, width=300, heads=4, dim=128, q_dtype=torch.float16, key_dtype=torch.float16, seed=23),
    Case(queries=9, width=130, visible="none", heads=8, dim=128, q_dtype=torch.bfloat16, key_dtype=torch.bfloat16,
         seed=24),  # nothing visible: every tile skipped
    Case(queries=129, width=257, visible="all", heads=12, dim=128, q_dtype=torch.bfloat16,
         key_dtype=torch.bfloat16, seed=25),  # one query and one entry past whole tiles
]  # fmt: skip


def causal(case: Case, start: int) -> tuple:
    """The case's inputs with a prefill's view: query t at position start + t sees (start + t + 1) // 4 entries."""
    q, keys, weights, _ = make_inputs(case)
    visible = torch.div(torch.arange(start, start + case.queries) + 1, 4, rounding_mode="floor").clamp(max=case.width)
    return q, keys, weights, visible


def hopper_available() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    import dsinfer.ops.index_scores.hopper as hopper

    return hopper.gluon is not None


def check(inputs: tuple, stages: int, warpgroups: int) -> str | None:
    import dsinfer.ops.index_scores.triton as backend

    q, keys = inputs[0], inputs[1]
    if not backend.hopper_shared_keys_fits(q, keys):
        return f"the Gluon kernel does not take {tuple(q.shape)} x {tuple(keys.shape)} {q.dtype}"
    config = backend.ScoresConfig(64, 128 * warpgroups, 0, 0, 4 * warpgroups, stages, kernel=GLUON)
    got = backend.index_scores_launch(*inputs, config=config)
    expected = index_scores_reference(*inputs)
    if not torch.equal(torch.isinf(got), torch.isinf(expected)):
        return "-inf in other places"
    finite = torch.isfinite(expected)
    if finite.any():
        error = (got[finite] - expected[finite]).abs().max().item()
        limit = 1e-5 * max(1.0, expected[finite].abs().max().item())
        if not error <= limit:
            return f"max |gluon - reference| = {error:.3g} > {limit:.3g}"
    k = min(16, expected.shape[1])
    if not torch.equal(top_k_in_order(got, k)[0], top_k_in_order(expected, k)[0]):
        return "another top-k"
    return None


@pytest.mark.skipif(not hopper_available(), reason="the Gluon kernel runs on an sm_90 GPU with Gluon")
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("warpgroups", [1, 2])
def test_gluon_scores_match_the_reference_on_hopper(stages, warpgroups):
    failures = []
    for case in CASES:
        message = check(tuple(t.cuda() for t in make_inputs(case)), stages, warpgroups)
        failures += [] if message is None else [f"{case}: {message}"]
    for start in (0, 1000):  # a first chunk and a later one: both sides of the tiles' skip
        case = replace(CASES[0], width=(start + 200) // 4)
        message = check(tuple(t.cuda() for t in causal(case, start)), stages, warpgroups)
        failures += [] if message is None else [f"causal from {start}: {message}"]
    assert failures == []


@pytest.mark.skipif(not hopper_available(), reason="the Gluon kernel runs on an sm_90 GPU with Gluon")
def test_the_gluon_kernel_takes_only_what_it_fits():
    import dsinfer.ops.index_scores.triton as backend

    q, keys, _, _ = (t.cuda() for t in make_inputs(CASES[0]))
    assert backend.hopper_shared_keys_fits(q, keys)
    assert not backend.hopper_shared_keys_fits(q[:, :3], keys)  # heads not a whole number of groups
    assert not backend.hopper_shared_keys_fits(q.float(), keys.float())
    assert not backend.hopper_shared_keys_fits(q[..., :64], keys[:, :64])


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("warpgroups", [1, 2])
def test_gluon_kernel_builds_for_hopper_with_its_mma_overlapped(warpgroups):
    pytest.importorskip("triton")
    import dsinfer.ops.index_scores.hopper as hopper

    if hopper.gluon is None:
        pytest.skip("this Triton has no Gluon Hopper language")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = hopper._hopper_shared_keys_kernel
    pointers = {"q_ptr": "*bf16", "keys_ptr": "*bf16", "weights_ptr": "*fp32", "visible_ptr": "*i64",
                "scores_ptr": "*fp32"}  # fmt: skip
    constants = dict(NUM_STAGES=hopper.NUM_STAGES, WARPGROUPS=warpgroups)
    signature = {name: pointers.get(name) or ("constexpr" if name in constants else "fp32" if name == "scale"
                 else "i32") for name in kernel.arg_names}  # fmt: skip
    aligned = [i for i, name in enumerate(kernel.arg_names) if name.endswith("_ptr") or name.startswith("stride_")
               and name != "stride_wh"]  # fmt: skip
    source = GluonASTSource(kernel, signature, constexprs=constants,
                            attrs={(i,): [["tt.divisibility", 16]] for i in aligned})  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4 * warpgroups))
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group.sync.aligned 1;" in ptx
    assert compiled.metadata.shared <= 227 * 1024 // (3 - warpgroups)  # two programs a multiprocessor at one
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if tool.exists() and shutil.which(str(tool)):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
            handle.write(compiled.asm["cubin"])
            handle.flush()
            sass = subprocess.run([str(tool), "-c", handle.name], capture_output=True, text=True).stdout
        # overlapped: the compiler waits for all but one MMA (it serialises them with a wait for none after each
        # when it cannot keep the two products apart)
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
        assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") <= 2, "the MMAs were serialised"
