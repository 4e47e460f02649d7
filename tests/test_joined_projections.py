"""Joined projections (``DeepseekModel.join_projections``): one GEMM for the shared expert's gate and up, one for
every projection of an attention's input (``wq_a``, ``wkv``, the compressors' values and gates, the indexer's
``weights_proj``) and one for both projections of the low-rank query, with the parameters left as views of the
stacked weights.

Tolerance: a joined GEMM computes each output element as the same dot product over the same input row and weight
row as the separate GEMMs; only the blocking the BLAS library picks for the wider output may change the order of
the float32 sums, so the logits may differ by float32 rounding (relative 1e-5 here), never by a misrouted slice
(which moves them by order one).
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest
import torch

from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v4 import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.layers.attention import Attention
from dsinfer.layers.compressor import Compressor
from dsinfer.layers.joined_linear import JoinedLinears
from dsinfer.layers.rotary import apply_rope, normalize_and_rope, rope_and_round, step_rope_angles
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import build_random_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = (37, 21)  # two sequences: packed prefill, then decode steps of both at once (strided views of B rows)


def _logits(model, steps: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits of two packed prompts, then the logits of ``steps`` decode steps of both sequences."""
    config = model.config
    cache = KVCache(
        config, attention_layer_ratios(config, False), 2, 16, block_tokens_for(config), torch.float32, "cpu"
    )
    tables = [list(range(8)), list(range(8, 16))]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (length,), generator=generator) for length in PROMPTS]
    spans = [SequenceSpan(0, length, slot, tables[slot]) for slot, length in enumerate(PROMPTS)]
    positions = torch.cat([torch.arange(length) for length in PROMPTS])
    prefill = model(PackedBatch(torch.cat(prompts), positions, spans, cache))
    decoded = []
    for step in range(steps):
        positions = torch.tensor([length + step for length in PROMPTS])
        tokens = (positions * 7) % 200
        spans = [SequenceSpan(int(p), 1, slot, tables[slot]) for slot, p in enumerate(positions)]
        decoded.append(model(PackedBatch(tokens, positions, spans, cache)))
    return prefill, torch.cat(decoded)


def _assert_close(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, expected, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 1e-5


def _attentions(model) -> list[Attention]:
    return [module for module in model.modules() if isinstance(module, Attention)]


def _unjoin_attentions(model) -> None:
    """The projections as before the attention stacks: each GEMM on its own (the compressors keep theirs)."""
    for attn in _attentions(model):
        attn.joined_inputs = attn.joined_queries = None


def _storage_bytes(modules) -> int:
    """Bytes of every distinct storage the modules' parameters, buffers and tensor attributes (stacks) use."""
    storages = {}
    for top in modules:
        for module in top.modules():
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            for value in vars(module).values():
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
                elif isinstance(value, JoinedLinears):
                    tensors.append(value.weight)
            for tensor in tensors:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def _assert_views(joined: JoinedLinears) -> None:
    """Each linear of each group is the stack's rows at its offset, in order, and nothing else is in the stack."""
    start = 0
    for linears in joined.groups.values():
        for linear in linears:
            rows = linear.weight.shape[0]
            assert linear.weight.data_ptr() == joined.weight[start].data_ptr()
            assert torch.equal(linear.weight, joined.weight[start : start + rows])
            start += rows
    assert start == joined.weight.shape[0]


def test_joined_model_decodes_as_the_separate_projections_and_keeps_its_parameters():
    config = replace(tiny_config(), num_nextn_predict_layers=0)
    model = build_random_model(config, torch.float32, "cpu", seed=3)
    expected = _logits(model)
    names = sorted(name for name, _ in model.named_parameters())
    state = {name: value.clone() for name, value in model.state_dict().items()}
    attentions = _attentions(model)
    storage = _storage_bytes(attentions)
    weights = [weakref.ref(p) for attn in attentions for p in attn.parameters() if p.dim() == 2]
    model.join_projections()
    shared = model.layers[1].ffn.shared_experts
    attn = model.layers[1].attn  # CSA: compressor and indexer
    assert shared.joined_gate_up is not None and attn.joined_inputs is not None
    assert attn.joined_inputs.names == ["q_a", "kv", "compressor", "index_compressor", "index_weights"]
    assert attn.joined_queries.names == ["q", "index_q"]
    assert model.layers[2].attn.joined_inputs.names == ["q_a", "kv", "compressor"]  # HCA
    assert model.layers[2].attn.joined_queries is None
    assert model.layers[0].attn.joined_inputs.names == ["q_a", "kv"]  # window only
    for joined in (attn.joined_inputs, attn.joined_queries, model.layers[2].attn.joined_inputs):
        _assert_views(joined)
    for compressor in (attn.compressor, attn.indexer.compressor):  # the compressors' stacks are the layer's rows
        assert compressor.joined_projection.untyped_storage().data_ptr() == (
            attn.joined_inputs.weight.untyped_storage().data_ptr()
        )
    assert sorted(name for name, _ in model.named_parameters()) == names
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    gc.collect()  # the weights replaced by views are gone (nothing stale holds the separate copies)
    current = {id(p) for attn in attentions for p in attn.parameters()}
    assert all(ref() is None or id(ref()) in current for ref in weights)
    joined = sum(
        len(group) for a in attentions for j in (a.joined_inputs, a.joined_queries) if j for group in j.groups.values()
    )
    assert sum(ref() is None for ref in weights) == joined
    assert _storage_bytes(attentions) == storage  # no second copy of any weight
    assert shared.w3.weight.data_ptr() == shared.joined_gate_up[shared.w1.weight.shape[0] :].data_ptr()
    _assert_close(_logits(model), expected)
    with torch.no_grad():  # the stack follows in-place updates of the parameters (a state-dict load)
        shared.w1.weight.mul_(0)
        attn.indexer.weights_proj.weight.mul_(0)
    assert bool((shared.joined_gate_up[: shared.w1.weight.shape[0]] == 0).all())
    assert bool((attn.joined_inputs.group_weight("index_weights") == 0).all())


def test_joining_twice_keeps_the_stacks():
    model = build_random_model(replace(tiny_config(), num_nextn_predict_layers=0), torch.float32, "cpu", seed=4)
    model.join_projections()
    attn = model.layers[1].attn
    stacks = (attn.joined_inputs, attn.joined_queries, attn.compressor.joined_projection)
    storage = _storage_bytes(_attentions(model))
    model.join_projections()
    assert attn.joined_inputs is stacks[0] and attn.joined_queries is stacks[1]
    assert attn.compressor.joined_projection.data_ptr() == stacks[2].data_ptr()  # the same rows of the same stack
    assert _storage_bytes(_attentions(model)) == storage


@pytest.mark.parametrize("fp8_linears", ["dequantize", "keep"])
def test_tiny_checkpoint_joined_equals_separate_projections(tiny_checkpoint, fp8_linears):
    """The loader joins; the same weights run projection by projection give the same logits. FP8 linears kept as
    stored (not ``nn.Linear``) join a stack of their own (codes and scales), the other projections of the input
    still share a GEMM, and a kind with one group stays on its own."""
    model = load_model(tiny_checkpoint, progress=False, fp8_linears=fp8_linears)
    csa = next(attn for attn in _attentions(model) if attn.indexer is not None)
    hca = next(attn for attn in _attentions(model) if attn.compressor is not None and attn.indexer is None)
    if fp8_linears == "dequantize":
        assert csa.joined_inputs.names == ["q_a", "kv", "compressor", "index_compressor", "index_weights"]
        assert csa.joined_queries.names == ["q", "index_q"]
        assert hca.joined_inputs.names == ["q_a", "kv", "compressor"]
    else:  # wq_a, wkv, wq_b and the indexer's wq_b are FP8 linears; the tiny model's are no whole 128-row blocks
        assert csa.wq_a.out_features % 128 and hca.joined_inputs is None
        assert csa.wq_b.out_features % 128 == 0 == csa.indexer.wq_b.out_features % 128
        assert csa.joined_queries.names == ["q", "index_q"] and csa.joined_queries.weight is None  # an FP8 stack
        assert csa.joined_inputs.names == ["compressor", "index_compressor", "index_weights"]
    joined = _logits(model)
    _unjoin_attentions(model)
    _assert_close(joined, _logits(model))
    for module in model.modules():  # nothing joined at all
        if isinstance(module, Compressor):
            module.joined_projection = None
        if hasattr(module, "joined_gate_up"):
            module.joined_gate_up = None
    _assert_close(joined, _logits(model))


def test_decode_without_handed_projections_projects_the_entries_in_one_gemm(monkeypatch):
    """A caller that projects q and kv itself (speculative verification) hands no projections to
    ``_attend_decode``: the compressors' and indexer's rows of the input stack run there, with the same result."""
    model = build_random_model(replace(tiny_config(), num_nextn_predict_layers=0), torch.float32, "cpu", seed=5)
    model.join_projections()
    expected = _logits(model)
    attend_decode = Attention._attend_decode
    calls = []

    def without_projections(self, *args):
        calls.append(self.joined_inputs(args[0], ("compressor", "index_compressor", "index_weights")).keys())
        return attend_decode(self, *args[:7])

    forward = Attention.forward

    def projecting_q_and_kv_itself(self, x, batch, inv_freq, layer_id):  # as speculative verification does
        if not batch.is_decode:
            return forward(self, x, batch, inv_freq, layer_id)
        cos, sin = step_rope_angles(batch, inv_freq, ops=self.ops)
        projected = self._input_projections(x)
        q_latent = self.q_norm(projected["q_a"])
        q = self._query_projections(q_latent)["q"].view(-1, self.n_heads, self.head_dim)
        q = normalize_and_rope(q, self.config.rms_norm_eps, cos, sin, self.ops)
        kv = rope_and_round(projected["kv"], cos, sin, self.ops, self.kv_norm)
        out = self._attend_decode(x, q, q_latent, kv, batch, batch.cache.layers[layer_id], inv_freq)
        return self._project_out(apply_rope(out, cos, sin, inverse=True, ops=self.ops, in_place=True))

    monkeypatch.setattr(Attention, "_attend_decode", without_projections)
    monkeypatch.setattr(Attention, "forward", projecting_q_and_kv_itself)
    _assert_close(_logits(model), expected)
    assert ["compressor", "index_compressor", "index_weights"] in [list(names) for names in calls]
    assert ["compressor"] in [list(names) for names in calls]  # HCA


def test_the_overlapped_chains_are_independent(monkeypatch, swapped_beside):
    """Decode's two-stream chains (the shared expert beside the routed part, the cache writes beside the queries,
    each mHC site's weights beside its block) give bit-identical logits run in either order, and every decode
    layer runs them through ``beside``."""
    import dsinfer.layers.attention as attention
    import dsinfer.layers.moe as moe
    import dsinfer.models.block as block

    model = build_random_model(replace(tiny_config(), num_nextn_predict_layers=0), torch.float32, "cpu", seed=6)
    model.join_projections()
    expected = _logits(model)
    calls: dict[str, list[int]] = {"attention": [], "moe": [], "sites": []}
    monkeypatch.setattr(attention, "beside", swapped_beside(calls["attention"]))
    monkeypatch.setattr(moe, "beside", swapped_beside(calls["moe"]))
    monkeypatch.setattr(block, "beside", swapped_beside(calls["sites"]))
    got = _logits(model)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    layers, steps = len(model.layers), 6
    assert calls["attention"] == [2] * (layers * steps)  # decode steps only: two sequences a step
    assert calls["moe"] == [sum(PROMPTS)] * layers + [2] * (layers * steps)
    assert calls["sites"] == [sum(PROMPTS)] * (2 * layers) + [2] * (2 * layers * steps)  # two sites a layer
