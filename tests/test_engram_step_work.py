"""Work that V4.1's step no longer repeats: Engram rows dequantised straight into the GEMM's dtype, the gate's
``q_weight * k_weight`` kept from ``join_projections``, the streams gathered in one go with a kept first mix.
Each keeps the numbers bit for bit."""

from __future__ import annotations

import pytest
import torch

from dsinfer.engram.module import Engram, EngramTable, EngramTableFetcher
from dsinfer.kv.batch import PackedBatch
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import tiny_config_v41


@pytest.fixture(scope="module")
def model(tiny_v41_checkpoint) -> DeepseekV41:
    return load_model(tiny_v41_checkpoint, progress=False, engram_placement="device")


def _float32_rows(table: EngramTable, ids: torch.Tensor) -> torch.Tensor:
    """What the table's rows were before: dequantised in float32."""
    values = table.weight[ids].float().unflatten(-1, (-1, 32))
    return (values * table.scale[ids].float().unsqueeze(-1)).flatten(-2)


def _table(weight: torch.Tensor, exponents: torch.Tensor) -> EngramTable:
    table = EngramTable(*weight.shape)
    table.weight = weight
    table.scale = torch.pow(2.0, (exponents - 127).double()).float()
    return table


@pytest.mark.parametrize("stored", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_table_rows_in_any_dtype_are_the_float32_rows_converted(stored, dtype):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 64, generator=generator) * 100).clamp(-448, 448).to(stored)
    if stored == torch.float8_e4m3fn:
        weight[0] = torch.arange(64, dtype=torch.uint8).view(torch.float8_e4m3fn)  # codes of every magnitude
    low = 100 if dtype == torch.float16 else 0  # scales within float16's range where it is the target
    exponents = torch.randint(low, 255 - low, (300, 2), generator=generator)
    table = _table(weight, exponents)
    ids = torch.randint(0, 300, (7, 3), generator=generator)
    ids[0, 0] = 0
    got, want = table(ids, dtype), _float32_rows(table, ids).to(dtype)
    assert got.dtype == dtype and got.shape == (7, 3, 64)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_the_model_reads_rows_in_the_gemm_dtype_with_the_same_logits(model):
    tables = {block.layer_id: block.engram.embed for block in model.layers if block.engram is not None}
    assert all(table.weight.dtype == torch.float8_e4m3fn for table in tables.values())
    source = model.engram_source()
    assert source.out_dtype == model.embed.weight.dtype
    sequences = [[5, 17, 99, 3, 250, 7, 7, 8, 41, 12, 300, 2] * 3, [1, 2, 3, 4, 5, 6, 7]]
    with torch.inference_mode():
        got = model(PackedBatch.from_sequences(sequences))
        model.attach_engram_fetcher(EngramTableFetcher(tables))  # float32 rows, converted by each layer
        try:
            want = model(PackedBatch.from_sequences(sequences))
        finally:
            model.attach_engram_fetcher(None)
    assert torch.equal(got, want)


def _engram() -> Engram:
    config = tiny_config_v41()
    engram = Engram(config, config.engram_layer_ids[0])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        engram.q_weight.copy_(torch.randn(engram.q_weight.shape, generator=generator))
        engram.k_weight.copy_(torch.randn(engram.k_weight.shape, generator=generator))
    return engram


def test_gate_weight_is_kept_from_the_join_and_follows_changed_weights():
    engram = _engram().requires_grad_(False)
    engram.join_projections()
    kept = engram.gate_weight()
    assert torch.equal(kept, engram.q_weight.float() * engram.k_weight.float())
    assert engram.gate_weight() is kept
    with torch.inference_mode():
        assert engram.gate_weight() is kept
    with torch.no_grad():
        engram.q_weight.mul_(2)  # in place: the version moves
    changed = engram.gate_weight()
    assert changed is not kept and torch.equal(changed, engram.q_weight.float() * engram.k_weight.float())
    assert engram.gate_weight() is changed  # kept in turn
    engram.k_weight.data = engram.k_weight.data.to(torch.bfloat16)  # another tensor (a dtype change)
    assert torch.equal(engram.gate_weight(), engram.q_weight.float() * engram.k_weight.float())


def test_gate_weight_of_inference_tensors_is_computed_every_call():
    engram = _engram().requires_grad_(False)
    with torch.inference_mode():
        engram.q_weight.data = engram.q_weight.data.clone()
        engram.join_projections()
        first, second = engram.gate_weight(), engram.gate_weight()
    assert first is not second and torch.equal(first, second)


def test_gradients_reach_both_gate_weights_after_a_join():
    engram = _engram()
    engram.join_projections()
    streams = torch.randn(3, engram.hc_mult, engram.hidden_size)
    rows = torch.randn(3, engram.wkv.in_features // 32, 32)
    engram(streams, rows, None).sum().backward()
    assert engram.q_weight.grad is not None and engram.q_weight.grad.abs().sum() > 0
    assert engram.k_weight.grad is not None and engram.k_weight.grad.abs().sum() > 0


def _old_embed_streams(model: DeepseekV41, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    streams = model.copy_into_streams(model.embed(input_ids))
    pre_mix = torch.zeros(streams.shape[:-1], dtype=torch.float32)
    pre_mix[:, 0] = 1.0
    return streams, pre_mix


@pytest.mark.parametrize("tokens", [1, 5, 3, 9])
def test_embed_streams_equal_the_embedding_copied(model, tokens):
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    want_streams, want_mix = _old_embed_streams(model, ids)
    with torch.inference_mode():
        streams, mix = model.embed_streams(ids)
    assert streams.is_contiguous() and torch.equal(streams, want_streams)
    assert mix.dtype == torch.float32 and mix.is_contiguous() and torch.equal(mix, want_mix)


def test_embed_streams_under_autograd_train_the_embedding():
    torch.manual_seed(0)
    model = DeepseekV41(tiny_config_v41(), with_mtp=False)
    ids = torch.tensor([3, 7, 3])
    streams, mix = model.embed_streams(ids)
    assert torch.equal(mix, _old_embed_streams(model, ids)[1])
    streams.sum().backward()
    assert model.embed.weight.grad[3].eq(2 * model.config.hc_mult).all()
