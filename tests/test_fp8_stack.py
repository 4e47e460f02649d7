"""FP8 linears kept as stored: a stack of them (``Fp8Stack``) gives each linear's output bit for bit, leaves the
state dict alone and follows its linears' codes; the grouped ``wo_a`` through the op equals the dequantised
model's grouped projection; random models keep the release's FP8 linears on request, and the V4 tiny model's
logits with them kept equal the logits of the same codes dequantised."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_joined_projections import _logits
from torch import nn

from dsinfer.layers.fp8_linear import Fp8Linear, Fp8Stack
from dsinfer.layers.joined_linear import JoinedLinears
from dsinfer.models.native_random import build_native_model
from dsinfer.models.tiny import tiny_config
from dsinfer.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise


def fp8_linear(rows: int, inputs: int, seed: int, block=(16, 16)) -> Fp8Linear:
    weight = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(seed)) * inputs**-0.5
    codes, scale = quantize_fp8_blockwise(weight, block)
    return Fp8Linear(codes, scale, block, torch.float32)


def test_a_stack_gives_each_linears_output_and_keeps_the_state_dict():
    owner = nn.Module()
    owner.a, owner.b, owner.c = fp8_linear(32, 48, 0), fp8_linear(16, 48, 1), fp8_linear(48, 48, 2)
    x = torch.randn(3, 48)
    separate = [owner.a(x), owner.b(x), owner.c(x)]
    keys = set(owner.state_dict())
    joined = JoinedLinears.join({"ab": (owner.a, owner.b), "c": (owner.c,)})
    assert joined.weight is None and joined.names == ["ab", "c"]
    out = joined(x)
    assert torch.equal(out["ab"], torch.cat(separate[:2], dim=-1)) and torch.equal(out["c"], separate[2])
    assert torch.equal(joined(x, ("c",))["c"], separate[2])
    assert set(owner.state_dict()) == keys  # the stack is no buffer
    stack = joined.stacks[0].weight
    assert stack.holds(owner.a, owner.b, owner.c) and owner.b.codes.data_ptr() == stack.codes[32].data_ptr()
    assert JoinedLinears.join({"ab": (owner.a, owner.b), "c": (owner.c,)}, joined) is joined  # no second stack
    with torch.no_grad():  # a state-dict load writes the linears' codes in place: the stack sees it
        owner.b.codes.copy_(torch.zeros_like(owner.b.codes))
    assert torch.equal(joined(x)["ab"][:, 32:], torch.zeros(3, 16))


def test_a_stack_takes_whole_scale_blocks_of_one_kind_only():
    assert Fp8Stack.join(fp8_linear(24, 32, 0), fp8_linear(16, 32, 1)) is None  # 24 rows: a partial scale block
    assert Fp8Stack.join(fp8_linear(16, 32, 0), fp8_linear(16, 48, 1)) is None  # input widths differ
    assert Fp8Stack.join(fp8_linear(16, 32, 0), nn.Linear(32, 16, bias=False)) is None
    with pytest.raises(ValueError, match="16-row scale blocks"):
        Fp8Stack.join(fp8_linear(16, 32, 0), fp8_linear(16, 32, 1)).rows(8, 32)


def test_grouped_projection_equals_the_dequantised_einsum():
    linear = fp8_linear(4 * 16, 32, 5)
    x = torch.randn(5, 4 * 32)
    weight = dequantize_fp8_blockwise(linear.codes, linear.scale, linear.block, dtype=torch.float32)
    want = torch.einsum("tgi,goi->tgo", x.view(5, 4, 32), weight.view(4, 16, 32)).reshape(5, 64)
    torch.testing.assert_close(linear(x, groups=4), want, rtol=0, atol=1e-6)


@torch.no_grad()
def test_random_model_keeps_the_release_fp8_linears_and_computes_their_dequantisation():
    config = replace(tiny_config(), num_nextn_predict_layers=0)
    kept = build_native_model(config, torch.float32, "cpu", seed=3, fp8_linears="keep")
    names = {name for name, module in kept.named_modules() if isinstance(module, Fp8Linear)}
    assert {"layers.0.attn.wq_a", "layers.0.attn.wo_a", "layers.0.ffn.shared_experts.w2"} <= names
    assert not any(name.endswith(("compressor.wkv", "gate")) for name in names)
    # The same model with every kept linear dequantised back into an nn.Linear computes the same logits.
    plain = build_native_model(config, torch.float32, "cpu", seed=3, fp8_linears="keep")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = plain.get_submodule(parent_name)
        fp8 = getattr(parent, child)
        linear = nn.Linear(fp8.in_features, fp8.out_features, bias=False)
        linear.weight.data = fp8.weight
        setattr(parent, child, linear)
    plain.join_projections()
    for got, want in zip(_logits(kept), _logits(plain), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fp8_linears"):
        build_native_model(config, torch.float32, "cpu", fp8_linears="fp8")
