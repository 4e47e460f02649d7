"""A small checkpoint on a CPU is served with float weights: the same outputs as its FP8 / FP4 form."""

from __future__ import annotations

import torch

from dsinfer.layers.moe import MoE
from dsinfer.models.loader import load_model
from dsinfer.models.small_cpu_weights import dequantize_experts_, is_small_cpu_checkpoint, small_cpu_fp8_linears
from dsinfer.models.tiny import make_tiny_checkpoint_v41


def test_float_weights_give_the_same_outputs_as_the_checkpoint_precision(tmp_path, monkeypatch):
    monkeypatch.delenv("DSINFER_FP8_LINEARS", raising=False)
    make_tiny_checkpoint_v41(tmp_path)
    assert is_small_cpu_checkpoint(tmp_path, "cpu") and not is_small_cpu_checkpoint(tmp_path, "cuda")
    assert small_cpu_fp8_linears(tmp_path, "cpu") == "dequantize"
    kept = load_model(tmp_path, progress=False, fp8_linears="keep")
    floats = load_model(tmp_path, progress=False, fp8_linears=small_cpu_fp8_linears(tmp_path, "cpu"))
    assert dequantize_experts_(floats, torch.float32) > 0
    assert not any(isinstance(m, MoE) and m.routed_weights().is_fp4 for m in floats.modules())
    generator = torch.Generator().manual_seed(0)
    layers = [(a, b) for a, b in zip(kept.modules(), floats.modules(), strict=True) if isinstance(a, MoE)]
    for kept_moe, float_moe in layers:
        x = torch.randn(5, kept.config.hidden_size, generator=generator)
        assert torch.equal(kept_moe(x), float_moe(x))
    fp8_kept = [m for m in kept.modules() if type(m).__name__ == "Fp8Linear"]
    assert fp8_kept and not [m for m in floats.modules() if type(m).__name__ == "Fp8Linear"]


def test_a_set_fp8_policy_wins(tmp_path, monkeypatch):
    make_tiny_checkpoint_v41(tmp_path)
    monkeypatch.setenv("DSINFER_FP8_LINEARS", "keep")
    assert small_cpu_fp8_linears(tmp_path, "cpu") is None
