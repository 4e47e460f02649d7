"""The engine with image spans (tiny V4.1 vision checkpoint): chunked prefill, preemption and prefix-cache
hits produce exactly the tokens of full forwards with the spans spliced in, and images are encoded once.

Fake quantization is off for the same reason as in tests/test_engine_v41.py (two evaluation orders)."""

from __future__ import annotations

import io

import pytest
import torch
from engine_harness import random_prompts, use_oracle_drafts
from PIL import Image

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.images.inputs import expand_placeholders, image_from_bytes
from dsinfer.kv.batch import ImageSplice, PackedBatch
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model(tiny_v41_vision_checkpoint):
    return load_model(tiny_v41_vision_checkpoint, progress=False).set_fake_quantization(False)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def picture(width: int, height: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, "PNG")
    return buffer.getvalue()


def requests_with_images(model, count: int) -> list[tuple[list[int], list]]:
    """Random prompts with one or two images each (some pictures shared across requests)."""
    token, vision = model.config.image_token_id, model.config.vision
    pictures = [image_from_bytes(picture(70 + 13 * i, 90 - 7 * i, i), vision) for i in range(3)]
    out = []
    for index, prompt in enumerate(random_prompts(count, seed=3, low=4, high=40)):
        images = [pictures[index % 3]] + ([pictures[(index + 1) % 3]] if index % 2 else [])
        prompt = [t if t != token else 3 for t in prompt]  # random ids may hit the image token id
        cut = len(prompt) // 2
        ids = prompt[:cut] + [token] + prompt[cut:] + ([token] if index % 2 else [])
        out.append(expand_placeholders(ids, images, token))
    return out


def greedy_by_recompute(model, requests, max_tokens: int) -> list[list[int]]:
    """Each token from a full forward of the whole sequence, its image spans spliced in."""
    results = []
    for ids, images in requests:
        seq = list(ids)
        spans = model.encode_images(images)
        rows = torch.cat([torch.arange(image.offset, image.end) for image in images])
        for _ in range(max_tokens):
            batch = PackedBatch.from_sequences([seq])
            batch.image_splice = ImageSplice(rows, torch.cat(spans))
            seq.append(int(model(batch, logits_for=batch.last_token_indices()).argmax(-1)))
        results.append(seq[len(ids) :])
    return results


def run(engine: LLMEngine, requests, params) -> list[list[int]]:
    ids = [engine.add_request(prompt, params, images=images) for prompt, images in requests]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def test_chunked_prefill_preemption_and_prefix_hits_with_images_equal_full_recompute(model, tiny_v41_vision_checkpoint):
    requests = requests_with_images(model, 8)
    assert all(image.offset > 0 for _, images in requests for image in images)
    tokenizer = Tokenizer.from_dir(tiny_v41_vision_checkpoint)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=112, num_cache_blocks=14,
                          block_tokens=8)  # fmt: skip
    engine = LLMEngine(model, tokenizer, config)
    try:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        outputs = run(engine, requests, params)
        assert engine.scheduler.num_preemptions > 0  # the small cache forced recomputation
        assert outputs == greedy_by_recompute(model, requests, 5)
        encoded = engine.runner.image_embeddings.images_encoded
        assert encoded <= 3 + engine.scheduler.num_preemptions * 2  # chunks of one span reuse one encoding
        hits = engine.blocks.prefix_hits
        again = run(engine, requests[-2:], params)  # the latest prompts and pictures again: the prefix cache
        assert engine.blocks.prefix_hits > hits and again == outputs[-2:]
        assert engine.blocks.num_used == 0
    finally:
        engine.close()


def test_dspark_speculation_splices_the_images_into_its_forward(model, tiny_v41_vision_checkpoint):
    """Speculative steps build their batch as plain ones do: image spans encoded and spliced in."""
    requests = requests_with_images(model, 4)
    expected = greedy_by_recompute(model, requests, 6)
    spec = {"method": "dspark", "num_speculative_tokens": 3}
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=112, num_cache_blocks=40,
                          block_tokens=8, speculative_config=spec)  # fmt: skip
    engine = LLMEngine(model, Tokenizer.from_dir(tiny_v41_vision_checkpoint), config)
    try:
        use_oracle_drafts(engine, {f"req-{i}": tokens for i, tokens in enumerate(expected)})
        assert run(engine, requests, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) == expected
        assert engine.spec_stats.num_accepted_tokens > 0 and engine.blocks.num_used == 0
    finally:
        engine.close()


def test_engine_rejects_images_off_their_placeholders(model, tiny_v41_vision_checkpoint, tiny_v41_checkpoint):
    tokenizer = Tokenizer.from_dir(tiny_v41_vision_checkpoint)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=2, num_cache_blocks=8, max_model_len=160))
    try:
        ((ids, images),) = requests_with_images(model, 1)
        moved = [images[0].__class__(images[0].patches, images[0].plan, images[0].content_hash, 0)]
        with pytest.raises(ValueError, match="images\\[0\\]: the prompt does not hold the image token id"):
            engine.add_request(ids, SamplingParams(max_tokens=1), images=moved)
        assert not engine.requests
    finally:
        engine.close()
    text_only = load_model(tiny_v41_checkpoint, progress=False)
    engine = LLMEngine(text_only, tokenizer, EngineConfig(max_num_seqs=2, num_cache_blocks=8, max_model_len=160))
    try:
        with pytest.raises(ValueError, match="no vision tower"):
            engine.add_request(ids, SamplingParams(max_tokens=1), images=images)
    finally:
        engine.close()
