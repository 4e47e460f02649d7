"""``benchmarks/verify_op_count.py``: ops a forward of each graphed kind on the tiny V4 with MTP, counted on the CPU:
a verify forward (K + 1 positions a sequence) dispatches more than a plain decode forward and less than K + 1 of
them, the launch proxy below the aten count, every kind counted; and the graphs' own work (snapshot, journal,
rollback) keeps a verify under 2.5 plain forwards' launches and a K = 3 draft under 2.3; with ``--admissions`` the
steps that prefill a prompt, plain and with DSpark's first drafts deferred; ``--kernels``' estimate counts each
Triton launch of a CUDA backend run in the interpreter and each aten op outside one, by source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import verify_op_count  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_verify_forward_counts_between_one_and_k_plus_one_plain_forwards():
    counts = verify_op_count.main(["--tiny", "v4", "--method", "mtp", "--k", "3", "--prompts", "2",
                                   "--max-tokens", "8"])  # fmt: skip
    assert set(counts) == {"plain", "verify", "draft"}
    plain, verify = counts["plain"], counts["verify"]
    for row in counts.values():
        assert row["forwards"] > 0 and 0 < row["launch_proxy"] < row["aten_ops"]
    assert plain["aten_ops"] < verify["aten_ops"] < 4 * plain["aten_ops"]
    assert plain["launch_proxy"] < verify["launch_proxy"] < 4 * plain["launch_proxy"]
    assert verify["launch_proxy"] < 2.5 * plain["launch_proxy"]
    assert counts["draft"]["launch_proxy"] < 2.3 * plain["launch_proxy"]


def test_a_deferred_dspark_admission_adds_seeding_but_no_draft():
    """Where graphs are captured a prompt's last chunk drafts nothing (its first drafts run in the next step's
    draft replay): the admitting steps then cost plain's plus the drafter's seeding, well under one draft."""
    admissions = verify_op_count.main(["--tiny", "v41", "--prompts", "2", "--admissions"])
    rounds = verify_op_count.main(["--tiny", "v41", "--prompts", "1", "--max-tokens", "8"])
    assert set(admissions) == {"admit", "admit+drafter"}
    added = admissions["admit+drafter"]["launch_proxy"] - admissions["admit"]["launch_proxy"]
    assert 0 < added < 0.5 * rounds["draft"]["launch_proxy"]


KERNEL_COUNT = """
import json, sys
sys.path.insert(0, "benchmarks")
import torch
import verify_op_count as v
from dsinfer.ops import registry
totals = {}
with v.registry_ops_counted(), v.interpreted_kernels():
    table = registry.resolve("cpu", torch.float32)
    backend = table.chosen["rms_norm"].name
    forward = v._counted(totals, "norm", lambda x, w: table.rms_norm(x, w, 1e-6) * 2, sites=True)
    forward(torch.randn(4, 64), torch.ones(64))
after = registry.resolve("cpu", torch.float32).chosen["rms_norm"].name
print(json.dumps({"backend": backend, "after": after, **v.per_forward(totals)["norm"]}))
"""


def interpreted_json(script: str):
    """``script``'s last printed line as JSON, run in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton reads it
    when it loads) from the project root."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_kernel_estimate_counts_a_triton_launch_and_the_glue_beside_it():
    """Under the interpreter a CUDA backend serves the CPU while the estimate is open (and not after): its kernel
    counts once, by its registry op, and an aten op outside any registry op counts once, by where it ran."""
    row = interpreted_json(KERNEL_COUNT)
    assert (row["backend"], row["after"]) == ("triton", "reference")
    assert row["kernels"] == 2
    assert row["sites"] == {"triton _rms_norm_kernel in rms_norm": 1.0, "aten::mul in outside the model": 1.0}


def test_the_kernel_estimate_needs_the_interpreter_and_sites_need_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for argv in (["--kernels"], ["--sites", "3"]):
        with pytest.raises(SystemExit) as exit_info:
            verify_op_count.main(argv)
        assert exit_info.value.code == 2


LAUNCH_FREE = """
import json, sys
sys.path.insert(0, "benchmarks")
import torch
import verify_op_count as v
from dsinfer.ops import registry
from dsinfer.ops.triton_support import triton
ran = []
run = triton.runtime.interpreter.InterpretedFunction.run
triton.runtime.interpreter.InterpretedFunction.run = lambda *a, **k: ran.append(1) or run(*a, **k)
totals = {}
x, weight = torch.randn(4, 64), torch.rand(64) + 0.5
with v.registry_ops_counted(launch_free=True), v.interpreted_kernels():
    table = registry.resolve("cpu", torch.float32)
    outside = table.rms_norm(x, weight, 1e-6)
    forward = v._counted(totals, "norm", lambda x, w: table.rms_norm(x, w, 1e-6), sites=True)
    inside = forward(x, weight)
expected = registry.reference_table("cpu", torch.float32).rms_norm(x, weight, 1e-6)
print(json.dumps({"ran": len(ran), "outside": torch.equal(outside, expected), "inside": torch.equal(inside, expected),
                  **v.per_forward(totals)["norm"]}))
"""


def test_launch_free_counting_runs_no_kernel_and_returns_the_references_result():
    """``--kernels`` counts each Triton launch without running it (the interpreter would take minutes a forward):
    the op's reference gives the result, uncounted, and ops outside a counted forward run their references."""
    row = interpreted_json(LAUNCH_FREE)
    assert (row["ran"], row["outside"], row["inside"]) == (0, True, True)
    assert row["sites"] == {"triton _rms_norm_kernel in rms_norm": 1.0}


def test_the_kernel_estimate_of_a_dspark_round_on_the_embedded_default():
    """The whole estimate in seconds: a DSpark K = 3 round's forwards on the embedded default, Sinkhorn's halves
    (run after ``hc_site_input`` returns) counted as its kernels, not as the reference's aten ops."""
    argv = ["--prompts", "1", "--max-tokens", "6", "--kernels", "--sites", "400"]
    counts = interpreted_json(f"import json, sys; sys.path.insert(0, 'benchmarks'); import verify_op_count as v; "
                              f"print(json.dumps(v.main({argv})))")  # fmt: skip
    plain, verify, draft = counts["plain"], counts["verify"], counts["draft"]
    assert 100 < plain["kernels"] < verify["kernels"] < 3 * plain["kernels"]
    assert 0 < draft["kernels"] < plain["kernels"]
    assert plain["sites"]["triton _site_kernel in hc_site_input"] > 0
    assert not any("models/block.py" in site for site in plain["sites"])
