"""The resize plan and per-image token counts: ours against the Hugging Face formula and deepseek-recipe's
Rust preprocessor, which resizes images for the same V4.1 model independently of our code."""

from __future__ import annotations

import base64
import io
import math

import deepseek_recipe as recipe
import pytest
from PIL import Image

from dsinfer.config.vision import FLASH_VISION, VisionConfig
from dsinfer.images.inputs import expand_placeholders, image_from_bytes
from dsinfer.images.plan import num_image_tokens, plan_image

# (width, height): tiny, square, the min-pixel edge, landscape, portrait, very wide / tall, huge, odd sizes.
SIZES = [
    (1, 1), (10, 10), (32, 900), (544, 544), (543, 545), (640, 480), (480, 640), (800, 800), (1000, 700),
    (1024, 768), (1280, 720), (1920, 1080), (1080, 1920), (2048, 2048), (3000, 400), (400, 3000),
    (4000, 3000), (5000, 60), (60, 5000), (777, 333),
]  # fmt: skip


def hf_tokens(box_width: int, box_height: int, config: VisionConfig) -> int:
    """Hugging Face's count for a resized box: ceil(patches / ratio) per side, ``n_llm_h * (n_llm_w + 1) + 2``."""
    n_llm_h = math.ceil((box_height // config.patch_size) / config.downsample_ratio)
    n_llm_w = math.ceil((box_width // config.patch_size) / config.downsample_ratio)
    return n_llm_h * (n_llm_w + 1) + 2


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (40, 120, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def test_twenty_sizes_match_the_formula_and_the_recipe_preprocessor():
    assert len(SIZES) == 20
    resolver = recipe.ImageResolver(recipe.ReqwestImageFetcher(), recipe.OpenCvImagePreprocessor())
    for width, height in SIZES:  # one call each: the library also caps a request's total image size
        (info,) = resolver.resolve([recipe.BytesImageSource(png(width, height))], recipe.ImageQuota()).images
        plan = plan_image(width, height, FLASH_VISION)
        assert (info.width, info.height) == (plan.width, plan.height), (width, height)
        assert plan.num_tokens == hf_tokens(plan.width, plan.height, FLASH_VISION), (width, height)
        assert plan.num_tokens == num_image_tokens(plan.llm_h, plan.llm_w) <= FLASH_VISION.max_image_tokens
        one = recipe.MultiModalData([info]).image_token_adjustment() + 1  # the library counts a placeholder as 1
        assert plan.num_tokens == one, (width, height)


def test_plan_upscales_small_images_and_caps_the_token_budget():
    small = plan_image(100, 100, FLASH_VISION)
    assert small.height * small.width >= FLASH_VISION.min_pixels
    huge = plan_image(8000, 8000, FLASH_VISION)
    assert huge.num_tokens <= 1024 and huge.num_tokens > 900  # shrunk to the budget, not far below it
    with pytest.raises(ValueError, match="0x5"):
        plan_image(0, 5, FLASH_VISION)


def test_patches_and_placeholder_expansion():
    image = image_from_bytes(png(100, 70), FLASH_VISION)
    plan = image.plan
    assert image.patches.shape == (plan.vit_h * plan.vit_w, 3 * 14 * 14)
    assert image.patches.min() >= -1 and image.patches.max() <= 1
    ids, placed = expand_placeholders([1, 9, 2, 9, 3], [image, image], 9)
    assert len(ids) == 3 + 2 * image.num_tokens
    assert [p.offset for p in placed] == [1, 2 + image.num_tokens]
    assert all(ids[p.offset + i] == 9 for p in placed for i in range(image.num_tokens))
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand_placeholders([9, 9], [image], 9)


def test_same_bytes_same_hash_different_bytes_different_hash():
    a, b = png(50, 50), png(51, 50)
    assert image_from_bytes(a, FLASH_VISION).content_hash == image_from_bytes(a, FLASH_VISION).content_hash
    assert image_from_bytes(a, FLASH_VISION).content_hash != image_from_bytes(b, FLASH_VISION).content_hash


def test_data_url_round_trip_is_what_the_recipe_reads():
    url = "data:image/png;base64," + base64.b64encode(png(30, 20)).decode()
    resolver = recipe.ImageResolver(recipe.ReqwestImageFetcher(), recipe.OpenCvImagePreprocessor())
    (info,) = resolver.resolve([recipe.DataUrlImageSource(url)], recipe.ImageQuota()).images
    plan = plan_image(30, 20, FLASH_VISION)
    assert (info.width, info.height) == (plan.width, plan.height)
