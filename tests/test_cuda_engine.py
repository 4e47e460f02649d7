"""On CUDA the engine gives the CPU's greedy tokens (tiny V4, and V4.1 with its rounding off; fp32), with the
decode steps' independent chains on the side stream, and bit for bit the logprobs it gives on one stream.

Kernels that race across streams (a chain reading what the other has not yet written) pass every op test that
runs one op at a time; only the whole model on CUDA shows them. The side stream only reorders kernels, so any
difference from ``DSINFER_OVERLAP=0`` is a race, even one too small to flip a token. This is the short form of
``benchmarks/cuda_engine_check.py``. Skipped without a GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch
from engine_harness import random_prompts

import dsinfer.llm as llm_module
import dsinfer.ops.side_stream as side_stream_module
from dsinfer.llm import LLM
from dsinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

OPTIONS = {"max_num_seqs": 4, "max_num_batched_tokens": 128, "max_model_len": 256, "dtype": "float32"}


def _greedy(checkpoint, device: str, rounding: bool) -> list:
    """The greedy completions (``CompletionOutput``, with each chosen token's logprob) of six random prompts."""
    prompts = random_prompts(6, seed=11, low=5, high=180)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    options = dict(OPTIONS, cache_memory_bytes=1 << 28) if device == "cuda" else OPTIONS
    with pytest.MonkeyPatch.context() as patch:
        if not rounding:  # the engine loads the model itself: turn the rounding off as it does
            loader = llm_module.load_engine_model
            patch.setattr(llm_module, "load_engine_model", lambda *a, **k: loader(*a, **k).set_fake_quantization(False))
        with LLM(str(checkpoint), device=device, **options) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [output.outputs[0] for output in outputs]


@pytest.mark.parametrize(("arch", "rounding"), [("v4", True), ("v41", False)])
def test_cuda_engine_equals_cpu(arch, rounding, tiny_checkpoint, tiny_v41_checkpoint, monkeypatch):
    checkpoint = tiny_checkpoint if arch == "v4" else tiny_v41_checkpoint
    cpu = _greedy(checkpoint, "cpu", rounding)
    uses = []  # the devices of each step that sent a chain to the side stream
    chosen = side_stream_module.side_stream
    monkeypatch.setattr(side_stream_module, "side_stream", lambda device: uses.append(device) or chosen(device))
    cuda = _greedy(checkpoint, "cuda", rounding)
    assert uses, "no decode step ran a chain on the side stream"
    differing = [i for i, (a, b) in enumerate(zip(cpu, cuda, strict=True)) if a.token_ids != b.token_ids]
    assert not differing, f"CUDA greedy tokens differ from the CPU's for prompts {differing}"
    uses.clear()
    monkeypatch.setenv("DSINFER_OVERLAP", "0")
    one_stream = _greedy(checkpoint, "cuda", rounding)
    assert not uses, "DSINFER_OVERLAP=0 still used the side stream"
    assert all(c.logprobs and len(c.logprobs) == len(c.token_ids) for c in cuda + one_stream), "logprobs missing"
    racing = [i for i, (a, b) in enumerate(zip(cuda, one_stream, strict=True)) if a.logprobs != b.logprobs]
    assert not racing, f"the side stream changed the logprobs of prompts {racing}: a race between the streams"
