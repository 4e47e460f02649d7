"""DeepInfer's published Pareto points, and the full-depth estimate of a slice's step to set beside them.

A sweep of a few-layer slice times a step of that slice; DeepInfer's charts time the whole model (43 layers for
V4-Flash, 40 for V4.1-Flash, plus the head). The estimate scales what grows with depth and keeps what does not:

    per_layer_ms   = (slice step ms - head ms) / slice layers
    full_depth_ms  = per_layer_ms x release layers + head ms

where head ms is the output head's GEMM for the step's sampled rows timed alone
(:func:`dsinfer.bench.sweep_timing.head_ms`). Everything else the slice step does once (embedding, sampling,
the scheduler) is counted as per-layer cost, so the estimate errs high; the slice's mix of layer kinds is not
the release's, and one GPU runs no expert parallelism, so it is an estimate, not a measurement.
"""

from __future__ import annotations

from typing import Any

from dsinfer.config import ModelConfig, ModelConfigV41

# Read off the DeepInfer README charts (B200, 131,072-token context, V4.1-Flash); approximate: no values printed.
PUBLISHED_B200 = {
    "prefill": [  # (batch tokens, ms/step, uncached input tokens/s/GPU), EP4DP4, bounded CED replay of 140
        (4096, 68.0, 60_000.0),
        (16384, 200.0, 81_000.0),
        (65536, 730.0, 89_000.0),
    ],
    "decode": [  # (requests per rank, tokens/s/user, tokens/s/GPU), EP64DP64, nextn=3, assumed accounting
        (8, 325.0, 2_600.0),
        (64, 248.0, 15_500.0),
        (256, 103.0, 26_000.0),
    ],
}
PUBLISHED_LABEL = "DeepInfer README, V4.1-Flash, B200, 131,072 context (approx.)"


def release_layers(arch: str) -> int:
    """Layers of the released model of ``arch`` ("v4": V4-Flash, "v41": V4.1-Flash)."""
    return ModelConfigV41().num_hidden_layers if arch == "v41" else ModelConfig().num_hidden_layers


def full_depth_estimate(
    ms_per_step: float, slice_layers: int, layers: int, head: float, tokens_per_step_per_user: float | None, point: int
) -> dict[str, Any]:
    """The slice's step scaled to ``layers`` (see the module doc); the throughputs at that step.

    ``tokens_per_step_per_user``: decode's tokens per step per sequence (tau of the accounting compared), and
    ``point`` its sequences; None for prefill, where ``point`` is the step's batch tokens."""
    per_layer = max(ms_per_step - head, 0.0) / slice_layers
    full = per_layer * layers + head
    estimate = {"release_layers": layers, "head_ms": head, "per_layer_ms": per_layer, "ms_per_step": full}
    if tokens_per_step_per_user is None:
        estimate["tokens_per_s_per_gpu"] = point / (full / 1e3)
    else:
        estimate["tokens_per_s_per_user"] = tokens_per_step_per_user / (full / 1e3)
        estimate["tokens_per_s_per_gpu"] = point * tokens_per_step_per_user / (full / 1e3)
    return estimate


def record_estimate(record: dict[str, Any], head: float) -> dict[str, Any]:
    """The full-depth estimate of one results record (decode under the accounting DeepInfer's chart uses: the
    assumed one when nextn > 0, else the measured tokens per step)."""
    tau = None
    if record["mode"] == "decode":
        accounting = record["assumed"] if record.get("nextn", 0) > 0 else record["measured"]
        tau = accounting["tokens_per_step_per_user"]
    layers = release_layers(record.get("arch", "v4"))
    return full_depth_estimate(record["ms_per_step"], record["num_layers"], layers, head, tau, record["point"])


def comparison_lines(records: list[dict[str, Any]]) -> list[str]:
    """The full-depth estimates beside DeepInfer's points, one line per swept point with an estimate."""
    mode = records[0]["mode"]
    published = {row[0]: row for row in PUBLISHED_B200.get(mode, [])}
    lines = [f"full-depth estimate (per-layer cost x release layers + head) beside {PUBLISHED_LABEL}:"]
    for record in records:
        estimate = record.get("full_depth")
        if estimate is None:
            continue
        ours = f"{estimate['ms_per_step']:8.2f} ms/step, {estimate['tokens_per_s_per_gpu']:9.0f} tok/s/GPU"
        if mode == "decode":
            ours += f", {estimate['tokens_per_s_per_user']:6.1f} tok/s/user"
        theirs = published.get(record["point"])
        if theirs is None:
            theirs_text = "no published point"
        elif mode == "decode":
            theirs_text = f"DeepInfer {theirs[2]:9.0f} tok/s/GPU, {theirs[1]:6.1f} tok/s/user"
        else:
            theirs_text = f"DeepInfer {theirs[1]:6.0f} ms/step, {theirs[2]:9.0f} tok/s/GPU"
        where = f"{mode} point {record['point']:>6} ({estimate['release_layers']} layers)"
        lines.append(f"  {where}: {ours} | {theirs_text}")
    return lines
