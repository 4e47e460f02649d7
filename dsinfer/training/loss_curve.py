"""The loss curve of a training run (``training.json``) as a PNG: assistant-token loss and DSpark draft loss."""

from __future__ import annotations

import json
from pathlib import Path


def plot_loss_curve(training_json: str | Path, png: str | Path) -> Path:
    """Write the curves of ``training_json``'s logged steps to ``png`` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    record = json.loads(Path(training_json).read_text())
    history = record["history"]
    steps = [r["step"] for r in history]
    figure, axis = plt.subplots(figsize=(7, 4), dpi=110)
    axis.plot(steps, [r["loss"] for r in history], label="assistant tokens (cross-entropy)")
    if any("draft_loss" in r for r in history):
        axis.plot(steps, [r.get("draft_loss") for r in history], label="DSpark draft loss")
    rounding_from = int(record["settings"]["steps"] * (1 - record["settings"]["rounding_phase"]))
    axis.axvline(rounding_from, color="grey", linestyle=":", label="straight-through FP8 / FP4 rounding on")
    axis.set_yscale("log")
    axis.set_xlabel(f"step (~{record['settings']['batch_tokens']} tokens each)")
    axis.set_ylabel("loss")
    axis.set_title(f"default model: {steps[-1] + 1} steps, {record['seconds'] / 60:.1f} min on {record['device']}")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png)
    plt.close(figure)
    return Path(png)
