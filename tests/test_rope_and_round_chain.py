"""``layers.rotary.rope_and_round``: where a layer's norm, RoPE and V4.1 rounding become the one ``rope_and_round``
op, and where they stay separate steps (no op table; a quantizer whose class overrides the point)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import RoundingPoint, apply_rope, rope_and_round
from dsinfer.ops.fake_quant import ActivationQuantizer, fake_quant_fp4, fake_quant_fp8
from dsinfer.ops.registry import resolve
from dsinfer.ops.rope_round import RowChain


def inputs():
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 64, generator=generator) * 3).bfloat16()
    angles = torch.rand(5, 8, generator=generator) * 100
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=generator) + 0.5)
    return x, angles.cos(), angles.sin(), norm


def recording_table(calls: list):
    table = resolve("cpu", torch.bfloat16)

    def fused(inputs):
        calls.append((inputs.weight, inputs.eps, inputs.rounding, inputs.block))
        return table.rope_and_round(inputs)

    return SimpleNamespace(rope_and_round=fused, rope=table.rope)


def test_each_point_fuses_with_its_own_format_and_block():
    x, cos, sin, norm = inputs()
    quantizer, calls = ActivationQuantizer(), []
    ops = recording_table(calls)
    positions = torch.arange(5)
    got = rope_and_round(x, cos, sin, ops, norm, RoundingPoint(quantizer, "window_kv", 0, positions))
    assert torch.equal(got, fake_quant_fp8(apply_rope(norm(x), cos, sin), 32))
    got = rope_and_round(x, cos, sin, ops, None, RoundingPoint(quantizer, "compressed_kv", 0, positions))
    assert torch.equal(got, fake_quant_fp4(apply_rope(x, cos, sin), 16, True))
    rope_and_round(x, cos, sin, ops, norm, RoundingPoint(quantizer, "index_keys", 0, positions))
    rope_and_round(x, cos, sin, ops, None, RoundingPoint(quantizer, "index_queries", 0, positions))
    assert [(w is not None, r, b) for w, _, r, b in calls] == [
        (True, "fp8", 32),
        (False, "fp4_e4m3", 16),
        (True, "fp4_ue8m0", 32),
        (False, "fp4_ue8m0", 32),
    ]
    assert calls[0][0] is norm.weight and calls[0][1] == norm.eps


def test_rounding_off_leaves_the_norm_and_rope_in_the_one_op():
    x, cos, sin, norm = inputs()
    calls = []
    ops = recording_table(calls)
    off = ActivationQuantizer(enabled=False)
    got = rope_and_round(x, cos, sin, ops, norm, RoundingPoint(off, "window_kv", 0, torch.arange(5)))
    assert torch.equal(got, apply_rope(norm(x), cos, sin)) and calls[-1][2] is None
    assert torch.equal(
        rope_and_round(x, cos, sin, ops, None, RoundingPoint(off, "index_queries", 0, None)), apply_rope(x, cos, sin)
    )
    assert torch.equal(rope_and_round(x, cos, sin, ops, None), apply_rope(x, cos, sin))
    assert [call[0] is None and call[2] is None for call in calls] == [False, True, True]


def test_a_quantizer_that_overrides_the_point_sees_the_rotated_rows():
    class Recording(ActivationQuantizer):
        def __init__(self):
            super().__init__()
            self.seen = []

        def window_kv(self, x, layer, positions):
            self.seen.append((x.clone(), layer))
            return super().window_kv(x, layer, positions)

    x, cos, sin, norm = inputs()
    quantizer, calls = Recording(), []
    got = rope_and_round(
        x, cos, sin, recording_table(calls), norm, RoundingPoint(quantizer, "window_kv", 3, torch.arange(5))
    )
    assert calls == [] and len(quantizer.seen) == 1
    rotated, layer = quantizer.seen[0]
    assert layer == 3 and torch.equal(rotated, apply_rope(norm(x), cos, sin))
    assert torch.equal(got, fake_quant_fp8(rotated, 32))


def test_without_an_op_table_the_steps_run_as_references():
    x, cos, sin, norm = inputs()
    got = rope_and_round(
        x, cos, sin, None, norm, RoundingPoint(ActivationQuantizer(), "index_keys", 0, torch.arange(5))
    )
    assert torch.equal(got, fake_quant_fp4(apply_rope(norm(x), cos, sin), 32, False))


def test_defer_hands_the_one_op_to_the_cache_write_as_a_row_chain():
    """``defer``: where the chain is the one op, its arguments come back (the cache write runs them with its
    store); where it is not (no op table, a quantizer overriding the point), the rows themselves."""
    x, cos, sin, norm = inputs()
    ops, quantizer, positions = resolve("cpu", torch.bfloat16), ActivationQuantizer(), torch.arange(5)
    chain = rope_and_round(x, cos, sin, ops, norm, RoundingPoint(quantizer, "window_kv", 0, positions), defer=True)
    assert isinstance(chain, RowChain) and chain.ops is ops and chain.shape == x.shape
    assert chain.inputs.weight is norm.weight and (chain.inputs.rounding, chain.inputs.block) == ("fp8", 32)
    assert torch.equal(
        chain.rows(), rope_and_round(x, cos, sin, ops, norm, RoundingPoint(quantizer, "window_kv", 0, positions))
    )

    class Overriding(ActivationQuantizer):
        def window_kv(self, x, layer, positions):
            return super().window_kv(x, layer, positions)

    for table, rounding in ((None, quantizer), (ops, Overriding())):
        rows = rope_and_round(x, cos, sin, table, norm, RoundingPoint(rounding, "window_kv", 0, positions), defer=True)
        assert isinstance(rows, torch.Tensor) and torch.equal(rows, chain.rows())
