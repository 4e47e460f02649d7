"""The encoder sweep on the CPU (tiny tower): consistent records, a real PNG and summary, the script form, and
flag errors that name the flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dsinfer.bench import sweep
from dsinfer.bench.encoder_sweep import build_encoder
from dsinfer.config.vision import FLASH_VISION
from dsinfer.images.plan import plan_image
from dsinfer.models.tiny import TINY_VISION

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]


def test_encoder_sweep_writes_results_chart_and_summary(tmp_path):
    argv = ["encoder", "--vision-width", "tiny", "--image-size", "84", "--points", "1,3", "--warmup-steps", "1",
            "--measure-steps", "2", "--device", "cpu", "--out-root", str(tmp_path), "--tag", "ve"]  # fmt: skip
    assert sweep.main(argv) == 0
    out = tmp_path / "ve"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["point"] for r in records] == [1, 3]
    plan = plan_image(84, 84, TINY_VISION)
    for record in records:
        assert record["mode"] == "encoder" and record["weights"] == "random" and record["steps"] == 2
        assert record["tokens_per_image"] == plan.num_tokens and record["patches_per_image"] == plan.num_patches
        assert abs(record["images_per_s_per_gpu"] - record["point"] * 1000 / record["ms_per_step"]) < 1e-6
        assert record["min_ms_per_step"] <= record["median_ms_per_step"] <= record["max_ms_per_step"]
        assert "vision_attention=reference" in record["ops"]
    assert (out / "pareto.png").read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((out / "summary.json").read_text())
    assert summary["points"] == [1, 3] and summary["pareto"] == "pareto.png" and summary["mode"] == "encoder"


def test_run_sweep_script_encoder_mode(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "VISION_WIDTH": "tiny", "DEVICE": "cpu",
           "POINTS": "2", "WARMUP_STEPS": "0", "MEASURE_STEPS": "1", "OUT_ROOT": str(tmp_path)}  # fmt: skip
    done = subprocess.run(["bash", str(ROOT / "scripts/run_sweep.sh"), "encoder", "ve-84", "84"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "ve-84" / "results.jsonl").read_text())
    assert record["point"] == 2 and record["image_size"] == 84
    assert (tmp_path / "ve-84" / "pareto.png").is_file()


def test_bad_flags_name_the_flag(tmp_path, capsys):
    assert sweep.main(["encoder", "--points", "0,2", "--device", "cpu", "--out-root", str(tmp_path)]) == 2
    assert "--points" in capsys.readouterr().err
    assert sweep.main(["encoder", "--image-size", "0", "--device", "cpu", "--out-root", str(tmp_path)]) == 2
    assert "--image-size" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written for a refused command


def test_flash_width_builds_in_the_compute_dtype_with_float32_norms():
    """One layer of the released widths (the sweep builds all 32 the same way, on the GPU)."""
    import dataclasses

    import torch

    one_layer = dataclasses.replace(FLASH_VISION, num_hidden_layers=1)
    encoder = build_encoder(one_layer, 5120, torch.device("cpu"), torch.bfloat16)
    block = encoder.vision.blocks[0]
    assert block.attn.wqkv.weight.shape == (3 * 1024, 1024) and block.mlp.w1.weight.shape == (2 * 2816, 1024)
    assert block.mlp.w1.weight.dtype == torch.bfloat16 and encoder.image_start.dtype == torch.bfloat16
    assert block.norm1.weight.dtype == encoder.vision.norm.weight.dtype == torch.float32
    assert encoder.aligner.w1.weight.shape == (5120, 1024 * 9)
    assert encoder.image_start.abs().sum() > 0  # random span embeddings, not zeros
