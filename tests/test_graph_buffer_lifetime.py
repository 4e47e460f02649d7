"""Buffers the model keeps between steps and hands to a forward stay alive as long as the model does.

A CUDA graph records the addresses a forward reads, not references to the tensors behind them. V4.1's forward
starts from rows of a one-hot block the model keeps (the first site's mix, ``embed_streams``) and makes that
block again, larger, when a step has more tokens than it holds. A decode, verify or draft graph captured before
such a step goes on reading the old block's address: if the model let go of it, the allocator hands that memory
to later tensors and every replay starts from whatever they wrote there (the graph's outputs drift while an
eager run stays right; on CUDA a second engine built on a model that has already served is enough). The CPU
cannot replay a graph, so the test checks the rule the graphs rely on: a block handed out is never freed.
"""

from __future__ import annotations

import gc
import weakref

import torch

from dsinfer.models.loader import load_model


def test_first_mix_rows_a_graph_may_have_captured_outlive_a_larger_step(tiny_v41_checkpoint):
    model = load_model(str(tiny_v41_checkpoint), dtype=torch.float32, device="cpu", progress=False)
    hc = model.config.hc_mult
    one_hot = torch.zeros(16, hc)
    one_hot[:, 0] = 1.0
    _, decode_mix = model.embed_streams(torch.zeros(16, dtype=torch.long))  # a 16-row decode step
    assert torch.equal(decode_mix, one_hot)
    block = decode_mix._base if decode_mix._base is not None else decode_mix
    held = weakref.ref(block)  # what a graph of that step would read: nothing but its address
    del decode_mix, block
    _, prefill_mix = model.embed_streams(torch.zeros(300, dtype=torch.long))  # a larger step grows the block
    assert prefill_mix.shape == (300, hc)
    gc.collect()
    block = held()
    assert block is not None, "the model freed first-mix rows a captured graph may still read"
    assert torch.equal(block[:16], one_hot), "the rows a captured graph reads changed"
