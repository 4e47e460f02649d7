"""One image as the engine carries it: normalised patches, its grids, and a content hash for the prefix cache.

An :class:`ImageInput` is made on the API side (decode, resize, patchify) and travels with its sequence. The
prompt holds one placeholder id per image; :func:`expand_placeholders` widens each into the image's span of
``num_tokens`` copies of that id (Hugging Face's layout: every span position carries the image token id, the
model tells them apart by the grid), and records where each span starts.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, replace

import torch

from dsinfer.config.vision import VisionConfig
from dsinfer.images.plan import ImagePlan, plan_image


@dataclass(frozen=True)
class ImageInput:
    """Patches [vit_h * vit_w, 3 * patch^2] (row-major, channel-major inside a patch) in [-1, 1]."""

    patches: torch.Tensor
    plan: ImagePlan
    content_hash: str  # sha256 of the encoded bytes and the plan: equal images share prefix-cache blocks
    offset: int = -1  # first prompt position of the span (set by expand_placeholders)

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def image_from_pixels(pixels: torch.Tensor, plan: ImagePlan, config: VisionConfig, content_hash: str) -> ImageInput:
    """Patchify a [3, H, W] uint8 image already fitted into its plan's box."""
    _, height, width = pixels.shape
    if (plan.height, plan.width) != (height, width):
        raise ValueError(f"image of {width}x{height} pixels is not at its planned size {plan.width}x{plan.height}")
    patch = config.patch_size
    values = (pixels.float() / 255.0 - 0.5) / 0.5
    grid = values.reshape(3, plan.vit_h, patch, plan.vit_w, patch).permute(1, 3, 0, 2, 4)
    return ImageInput(grid.reshape(plan.num_patches, config.patch_dim).contiguous(), plan, content_hash)


def content_hash(data: bytes, plan: ImagePlan) -> str:
    """The prefix cache's key for an image: its encoded bytes and the box it was planned into."""
    return hashlib.sha256(data + f"|{plan.height}x{plan.width}".encode()).hexdigest()


def decode_rgb(data: bytes):
    """Encoded bytes -> an RGB Pillow image (``ValueError`` when Pillow cannot read them)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"the image cannot be decoded ({exc})") from None


def pixels_of(image) -> torch.Tensor:
    """[3, H, W] uint8 of an RGB Pillow image."""
    flat = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return flat.reshape(image.height, image.width, 3).permute(2, 0, 1)


def fit_to_plan(image, plan: ImagePlan, config: VisionConfig):
    """The reference's fit: keep the aspect ratio (bicubic), pad the rest with gray 127, centred, like
    ``ImageOps.pad``; images wider than ``max_wh_ratio`` are squeezed into the box instead."""
    from PIL import Image, ImageOps

    box = (plan.width, plan.height)
    ratio = config.max_wh_ratio
    if ratio is not None and image.width >= ratio * image.height:
        return image.resize(box, Image.BICUBIC)
    if image.size == box:
        return image
    return ImageOps.pad(image, box, method=Image.BICUBIC, color=(127, 127, 127))


def image_from_bytes(data: bytes, config: VisionConfig) -> ImageInput:
    """Decode encoded image bytes (any format Pillow reads), fit them into the plan's box, patchify."""
    image = decode_rgb(data)
    plan = plan_image(image.width, image.height, config)
    return image_from_pixels(pixels_of(fit_to_plan(image, plan, config)), plan, config, content_hash(data, plan))


def expand_placeholders(
    prompt_ids: list[int], images: list[ImageInput], image_token_id: int
) -> tuple[list[int], list[ImageInput]]:
    """Widen the i-th ``image_token_id`` of ``prompt_ids`` into image i's span; the images get their offsets."""
    places = [i for i, token in enumerate(prompt_ids) if token == image_token_id]
    if len(places) != len(images):
        raise ValueError(f"the prompt has {len(places)} image placeholders for {len(images)} images")
    out: list[int] = []
    placed: list[ImageInput] = []
    previous = 0
    for place, image in zip(places, images, strict=True):
        out += prompt_ids[previous:place]
        placed.append(replace(image, offset=len(out)))
        out += [image_token_id] * image.num_tokens
        previous = place + 1
    out += prompt_ids[previous:]
    return out, placed
