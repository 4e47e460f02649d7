"""V4.1's decode step with joined projections (``AttentionV41.join_projections``) and RoPE angles computed once per
forward (``step_rope_angles``): the same logits, bit for bit, as every projection on its own.

A layer's input feeds one GEMM (``wq_a``, ``wkv``, a ratio-1 source's compressor ``wkv``, an index source's
``weights_proj``), its low-rank query another (``wq_b`` and the scorer's ``wq_b``); the parameters stay views of the
stacks. In bfloat16 a CPU GEMM computes each output element over the same row of the input and the weight whatever
the output's width, so joining changes no bit here.
"""

from __future__ import annotations

import pytest
import torch

import dsinfer.layers.rotary as rotary
from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.layers.csa2 import AttentionV41
from dsinfer.layers.joined_linear import JoinedLinears
from dsinfer.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_TOKENS = 8
PROMPTS = (29, 18)  # odd and even: the ratio-2 groups complete on alternate decode steps, not together


@pytest.fixture(params=["dequantize", "keep"])
def model(request, tiny_v41_checkpoint):
    """FP8 linears dequantized (every projection an ``nn.Linear``), or kept as stored (not joined: the others are)."""
    return load_model(tiny_v41_checkpoint, dtype=torch.bfloat16, progress=False, fp8_linears=request.param)


def _plain(model) -> bool:
    return type(model.layers[0].attn.wq_a) is torch.nn.Linear


def _attentions(model) -> list[AttentionV41]:
    return [layer.attn for layer in model.layers]


class Run:
    """Two packed prompts in a fresh cache, then decode steps of both at once."""

    def __init__(self, model, steps: int = 5) -> None:
        self.model, self.steps = model, 0
        per_sequence = -(-(max(PROMPTS) + steps) // BLOCK_TOKENS)
        self.cache = KVCacheV41(model.config, 2, 2 * per_sequence, BLOCK_TOKENS, torch.bfloat16, "cpu")
        self.tables = [list(range(s * per_sequence, (s + 1) * per_sequence)) for s in range(2)]
        self.generator = torch.Generator().manual_seed(0)

    def prefill(self) -> torch.Tensor:
        ids = torch.randint(3, 500, (sum(PROMPTS),), generator=self.generator)
        spans = [SequenceSpan(0, length, slot, self.tables[slot]) for slot, length in enumerate(PROMPTS)]
        batch = PackedBatch(ids, torch.cat([torch.arange(length) for length in PROMPTS]), spans, self.cache)
        return self.model(batch, logits_for=batch.device_spans.token_rows)

    def decode(self) -> torch.Tensor:
        positions = torch.tensor([length + self.steps for length in PROMPTS])
        spans = [SequenceSpan(int(p), 1, slot, self.tables[slot]) for slot, p in enumerate(positions)]
        ids = torch.randint(3, 500, (2,), generator=self.generator)
        self.steps += 1
        return self.model(PackedBatch(ids, positions, spans, self.cache))


def _logits(model, steps: int = 5) -> list[torch.Tensor]:
    run = Run(model, steps)
    return [run.prefill()] + [run.decode() for _ in range(steps)]


def _assert_views(joined: JoinedLinears) -> None:
    """The plain stack's linears are its rows at their offsets, in order, and nothing else is in it."""
    start = 0
    plain = next(stack for stack in joined.stacks if stack.weight is joined.weight)
    for linears in plain.groups.values():
        for linear in linears:
            rows = linear.weight.shape[0]
            assert linear.weight.data_ptr() == joined.weight[start].data_ptr()
            start += rows
    assert start == joined.weight.shape[0]


def test_each_layer_role_stacks_its_projections(model):
    config = model.config
    for layer_id, attn in enumerate(_attentions(model)):
        inputs = ["q_a", "kv"] if _plain(model) else []
        fp8 = [] if _plain(model) else ["q_a", "kv"]  # wq_a and wkv (and wq_b) are FP8 in the checkpoint: a stack
        if config.is_kv_source(layer_id) and config.compress_ratios[layer_id] == 1:
            inputs.append("compressor")  # no gate, model dtype: a row block of the input stack
        if config.is_index_source(layer_id):
            inputs.append("index_weights")
        stacks = [names for names in (fp8, inputs) if len(names) >= 2]  # one group of a kind: nothing to join
        if not stacks:
            assert attn.joined_inputs is None, layer_id
            continue
        assert [stack.names for stack in attn.joined_inputs.stacks] == stacks, layer_id
        if len(inputs) >= 2:
            _assert_views(attn.joined_inputs)
        if config.is_index_source(layer_id):
            assert attn.joined_queries.names == ["q", "index_q"]
            assert (attn.joined_queries.weight is not None) == _plain(model)  # else an FP8 stack
            if _plain(model):
                _assert_views(attn.joined_queries)
        else:
            assert attn.joined_queries is None
        if attn.compressor is not None and attn.compressor.wgate is not None and len(inputs) >= 2:
            # ratio 2 pools in fp32: on its own
            assert attn.compressor.joined_projection.untyped_storage().data_ptr() != (
                attn.joined_inputs.weight.untyped_storage().data_ptr()
            )
    names = {name for name, _ in model.named_parameters()}
    assert {"layers.5.attn.compressor.wkv.weight", "layers.7.attn.indexer.weights_proj.weight"} <= names


def test_joined_logits_are_bit_identical_to_separate_projections(model):
    joined = _logits(model)
    for attn in _attentions(model):
        attn.joined_inputs = attn.joined_queries = None
    separate = _logits(model)
    for step, (got, want) in enumerate(zip(joined, separate, strict=True)):
        assert torch.equal(got, want), step
    model.join_projections()  # joining again finds the weights still views of the stacks
    assert torch.equal(_logits(model)[-1], joined[-1])


def test_a_decode_step_computes_each_set_of_angles_once(model, monkeypatch):
    """The positions' angles under the window frequencies and under the compressed ones, and the ratio-2 groups'
    first positions' angles: three sets for every layer of a decode step (``rope_angles`` op calls), computed
    again in the next step."""
    calls = []
    ops = next(attn.ops for attn in _attentions(model) if attn.ops is not None)
    angles = ops.rope_angles

    def counted(positions, inv_freq, ratio=1):
        calls.append((positions, inv_freq, ratio))
        return angles(positions, inv_freq, ratio)

    monkeypatch.setattr(ops, "rope_angles", counted)
    monkeypatch.setattr(rotary, "rope_angles_reference", counted)  # a layer without bound ops
    run = Run(model)
    run.prefill()
    for _ in range(2):
        calls.clear()
        run.decode()
        assert len(calls) == 3
        (window, window_freq, one), (compressed, compressed_freq, also_one), (starts, starts_freq, two) = calls
        assert window is compressed and window_freq is model.rope.window and compressed_freq is model.rope.compressed
        assert starts is window and starts_freq is model.rope.compressed and (one, also_one, two) == (1, 1, 2)


def test_fp32_pooling_keeps_an_fp32_copy_of_its_stack_that_follows_the_weights(model):
    """A ratio-2 source projects in float32: its stack's fp32 copy is made once (at join time), not every step, and
    made again after an in-place update of the weights."""
    compressor = model.layers[1].attn.compressor
    assert compressor.pool_in_fp32 and compressor.wgate is not None
    fp32 = compressor._joined_in_fp32()
    assert fp32.dtype == torch.float32 and compressor._joined_in_fp32() is fp32
    assert torch.equal(fp32, compressor.joined_projection.float())
    with torch.no_grad():
        compressor.wgate.weight.mul_(2)
    updated = compressor._joined_in_fp32()
    assert updated is not fp32 and torch.equal(updated, compressor.joined_projection.float())


def test_the_overlapped_chains_are_independent(model, monkeypatch, swapped_beside):
    """V4.1's two-stream chains at decode (a layer's cache writes beside its queries, the shared expert beside the
    routed part, each mHC site's weights beside its block, whose collapse reads the previous site's) give
    bit-identical logits with the main chain run first; every decode layer runs them through ``beside``."""
    import dsinfer.layers.csa2 as csa2
    import dsinfer.layers.moe as moe
    import dsinfer.models.block as block

    calls: dict[str, list[int]] = {"attention": [], "moe": [], "sites": []}
    expected = _logits(model)
    monkeypatch.setattr(csa2, "beside", swapped_beside(calls["attention"]))
    monkeypatch.setattr(moe, "beside", swapped_beside(calls["moe"]))
    monkeypatch.setattr(block, "beside", swapped_beside(calls["sites"]))
    got = _logits(model)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    steps = 5
    assert calls["attention"] == [2] * (len(model.layers) * steps)
    assert len(calls["moe"]) >= len(model.layers) * (steps + 1)  # the prefill's layers, then each decode step's
    assert calls["sites"][-2 * len(model.layers) * steps :] == [2] * (2 * len(model.layers) * steps)
