"""The V4.1 image encoder: tiny vision checkpoints load in both spellings, the tower packs images correctly,
and image spans change what the text model computes exactly where they are spliced."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from dsinfer.images.inputs import expand_placeholders, image_from_bytes
from dsinfer.kv.batch import ImageSplice, PackedBatch
from dsinfer.models.loader import load_model
from dsinfer.models.vision import apply_rope_2d, rope_2d
from dsinfer.ops.registry import backends


def png(width: int, height: int, color=(200, 30, 60)) -> bytes:
    buffer = io.BytesIO()
    image = Image.new("RGB", (width, height), color)
    image.putpixel((0, 0), (0, 255, 0))
    image.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def model(tiny_v41_vision_checkpoint):
    return load_model(tiny_v41_vision_checkpoint, progress=False)


def test_checkpoint_holds_the_official_vision_tensors(tiny_v41_vision_checkpoint):
    index = json.loads((tiny_v41_vision_checkpoint / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    for name in ("vision.patch_embed.proj.weight", "vision.blocks.0.attn.wqkv.weight", "vision.blocks.1.mlp.w2.weight",
                 "vision.norm.weight", "aligner.w1.weight", "aligner.w2.bias", "image_start", "image_newline",
                 "image_end"):  # fmt: skip
        assert name in names, name
    config = json.loads((tiny_v41_vision_checkpoint / "config.json").read_text())
    assert config["vision_config"]["num_hidden_layers"] == 2
    assert config["image_token_id"] == 496  # the tiny tokenizer's <｜deepseek_image｜>


def test_hugging_face_spelling_loads_the_same_weights(tiny_v41_vision_checkpoint, model, tmp_path):
    """Hugging Face's V4.1 checkpoints keep the official names under ``model.`` (the head as ``lm_head``)."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_v41_vision_checkpoint, hf_dir)
    index_path = hf_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(hf_dir / shard)
        renamed = {("lm_head.weight" if k == "head.weight" else "model." + k): v for k, v in tensors.items()}
        save_file(renamed, hf_dir / shard, metadata={"format": "pt"})
    index["weight_map"] = {("lm_head.weight" if k == "head.weight" else "model." + k): v
                           for k, v in index["weight_map"].items()}  # fmt: skip
    index_path.write_text(json.dumps(index))
    hf = load_model(hf_dir, progress=False)
    official, other = model.state_dict(), hf.state_dict()
    vision = [name for name in official if name.startswith(("vision.", "aligner.", "image_"))]
    assert len(vision) > 20
    for name in vision:
        assert torch.equal(official[name], other[name]), name
    assert official["vision.norm.weight"].dtype == torch.float32  # norms stay float32
    assert official["vision.blocks.1.norm2.weight"].dtype == torch.float32


def test_vision_attention_is_an_op_with_a_reference():
    assert any(b.name == "reference" for b in backends("vision_attention"))


def test_packed_batch_equals_one_image_at_a_time(model):
    a = image_from_bytes(png(100, 70), model.config.vision)
    b = image_from_bytes(png(60, 130, (10, 200, 90)), model.config.vision)
    together = model.encode_images([a, b])
    alone = [model.encode_images([a])[0], model.encode_images([b])[0]]
    for joint, single, image in zip(together, alone, [a, b], strict=True):
        assert joint.shape == (image.num_tokens, model.config.hidden_size)
        torch.testing.assert_close(joint, single, rtol=1e-5, atol=1e-5)
    start, newline, end = model.image_start, model.image_newline, model.image_end
    plan = a.plan
    assert torch.equal(together[0][0], start) and torch.equal(together[0][-1], end)
    for row in range(plan.llm_h):  # a newline closes every aligner row
        assert torch.equal(together[0][1 + row * (plan.llm_w + 1) + plan.llm_w], newline)


def test_rope_2d_rotates_rows_and_columns_separately():
    angles = rope_2d(2, 3, 4, 10000.0, torch.device("cpu"))
    assert angles.shape == (6, 4)
    assert torch.equal(angles[4, :2], angles[3, :2])  # same row -> same height angles
    assert torch.equal(angles[4, 2:], angles[1, 2:])  # same column -> same width angles
    x = torch.randn(6, 2, 8)
    rotated = apply_rope_2d(x, angles.cos()[:, None], angles.sin()[:, None])
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths


def test_image_span_changes_logits_only_from_the_span_on(model):
    image = image_from_bytes(png(100, 70), model.config.vision)
    token = model.config.image_token_id
    ids, (placed,) = expand_placeholders([0, 20, 21, token, 22, 23], [image], token)
    plain = model(PackedBatch.from_sequences([ids]))
    batch = PackedBatch.from_sequences([ids])
    rows = torch.arange(placed.offset, placed.end)
    batch.image_splice = ImageSplice(rows, model.encode_images([image])[0])
    with_image = model(batch)
    torch.testing.assert_close(with_image[: placed.offset], plain[: placed.offset])  # causal: before is unchanged
    assert not torch.allclose(with_image[placed.end :], plain[placed.end :])


def test_text_only_model_refuses_images(tiny_v41_checkpoint):
    text_only = load_model(tiny_v41_checkpoint, progress=False)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.encode_images([])
