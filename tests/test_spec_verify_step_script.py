"""``benchmarks/spec_verify_step.py --tiny``: the verify-step table's rows on tiny checkpoints (the GPU run's
code path, the slices swapped for tiny checkpoints): plain and speculative points from the sweep, the ratio their
quotient, tau from the coin's accepted drafts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import spec_verify_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_the_verify_step_table_on_tiny_checkpoints(arch, tmp_path):
    out = tmp_path / "rows.json"
    rows = spec_verify_step.main(["--tiny", "--arch", arch, "--requests", "1,2", "--k", "1,3", "--warmup-steps", "1",
                                  "--measure-steps", "4", "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert [(row["requests"], row["k"]) for row in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert out.exists()
    for row in rows:
        assert row["method"] == {"v4": "mtp", "v41": "dspark"}[arch] and row["context"] == 24
        assert row["plain_ms"] > 0 and row["ratio"] == pytest.approx(row["verify_ms"] / row["plain_ms"])
        assert 1.0 <= row["tau"] <= row["k"] + 1
        assert row["speedup"] == pytest.approx(row["tau"] / row["ratio"])
        assert 1.0 < row["expert_bytes_floor"] < row["k"] + 1  # more experts to read, never K + 1 times the bytes
    # The coin accepts three quarters of the drafts: K = 3 gets well past one token a step.
    assert all(row["tau"] > 1.5 for row in rows if row["k"] == 3)
    assert len({row["plain_ms"] for row in rows if row["requests"] == 1}) == 1  # one plain point per request count


def test_the_mtp_rows_with_a_draft_token_map(monkeypatch):
    """``--draft-map-size``: the MTP drafter the rows time drafts from that many ids of the head."""
    from dsinfer.speculative.mtp import MTPDrafter

    built = []
    original = MTPDrafter.__init__

    def recording(self, model, cache, num_tokens, token_map=None):
        original(self, model, cache, num_tokens, token_map)
        built.append(None if self.draft_head is None else self.draft_head.shape[0])

    monkeypatch.setattr(MTPDrafter, "__init__", recording)
    rows = spec_verify_step.main(["--tiny", "--arch", "v4", "--requests", "1", "--k", "3", "--warmup-steps", "1",
                                  "--measure-steps", "3", "--device", "cpu", "--draft-map-size", "40"])  # fmt: skip
    assert built and set(built) == {40} and rows[0]["tau"] > 1.5


def test_a_fill_of_several_steps_leaves_room_for_the_drafts_decoded_meanwhile():
    """Requests whose prompts prefill over several steps: the first ones decode, up to K + 1 tokens a step, while
    the rest still prefill, and must not reach the end of their room inside the timed window."""
    rows = spec_verify_step.main(["--tiny", "--arch", "v4", "--requests", "4", "--k", "3", "--contexts", "96",
                                  "--prefill-chunk", "32", "--warmup-steps", "1", "--measure-steps", "3",
                                  "--device", "cpu"])  # fmt: skip
    assert [(row["requests"], row["k"]) for row in rows] == [(4, 3)] and rows[0]["tau"] > 1.5


def test_profiled_rows_carry_the_plain_and_the_verify_steps_profiles():
    """``--profile-steps``: each row has both points' profiles (on the CPU, the top-level torch ops a step); a verify
    step over K + 1 positions a sequence runs more of them than a plain step."""
    (row,) = spec_verify_step.main(["--tiny", "--arch", "v4", "--requests", "1", "--k", "3", "--warmup-steps", "1",
                                    "--measure-steps", "3", "--profile-steps", "2", "--device", "cpu"])  # fmt: skip
    plain, verify = row["profiles"]["plain"], row["profiles"]["verify"]
    assert plain["steps"] == verify["steps"] == 2
    assert 0 < plain["per_step"]["kernels"] < verify["per_step"]["kernels"]


def test_rows_reach_the_out_file_as_they_are_measured(tmp_path, monkeypatch, capsys):
    """A run stopped part way (a time limit on the GPU machine) keeps the rows it measured: ``--out`` is rewritten
    after each row, and each profiled row prints its costliest kernels."""
    out = tmp_path / "rows.json"
    calls, original = [], spec_verify_step._point

    def stopping(*args, **kwargs):
        calls.append(None)
        if len(calls) > 2:  # the plain and the verify point of the first row, then the run stops
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(spec_verify_step, "_point", stopping)
    with pytest.raises(KeyboardInterrupt):
        spec_verify_step.main(["--tiny", "--arch", "v4", "--requests", "1,2", "--k", "3", "--warmup-steps", "1",
                               "--measure-steps", "3", "--profile-steps", "1", "--device", "cpu",
                               "--out", str(out)])  # fmt: skip
    (row,) = json.loads(out.read_text())
    assert (row["requests"], row["k"]) == (1, 3) and set(row["profiles"]) == {"plain", "verify"}
    printed = capsys.readouterr().out
    assert "    plain: " in printed and "    verify: " in printed and "kernels" in printed


def test_the_expert_bytes_floor_of_a_uniform_router(monkeypatch):
    """The floor counts the experts a layer's rows touch in expectation: at V4-Flash's 256 experts, 6 a token, one
    row reads 6 and four rows ~23.2, 128 rows ~243.7 against 32 rows' ~136.1."""
    from types import SimpleNamespace

    fixed, per_expert = 2.08e9, 13.5e6  # bytes: the 4-layer slice's weights outside the routed experts, one expert
    monkeypatch.setattr(spec_verify_step, "weight_bytes", lambda model: (fixed, per_expert, 4))
    model = SimpleNamespace(config=SimpleNamespace(n_routed_experts=256, num_experts_per_tok=6))
    one = spec_verify_step.expert_bytes_floor(model, 1, 3)
    many = spec_verify_step.expert_bytes_floor(model, 32, 3)
    assert one == pytest.approx((fixed + 4 * per_expert * 23.169) / (fixed + 4 * per_expert * 6), rel=1e-3)
    assert many == pytest.approx((fixed + 4 * per_expert * 243.70) / (fixed + 4 * per_expert * 136.15), rel=1e-3)
    assert 1.38 < one < 1.40 and 1.61 < many < 1.64
