"""The V4.1 resize plan and the tokens an image costs, exactly as Hugging Face's processor computes them.

An image is upscaled to ``min_pixels`` if smaller, both sides are rounded up to whole patches, and when the
resulting aligner grid would cost more than ``max_image_tokens`` the image is shrunk by the closed-form
ratio the reference uses. The span in the text stream is ``n_llm_h * (n_llm_w + 1) + 2`` tokens: image
start, each aligner row followed by one newline, image end. deepseek-recipe's preprocessor resizes to the
same box (``tests/test_image_plan.py`` checks both against this plan); this module is what the engine counts
with, so a prompt's length is known before any pixel is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsinfer.config.vision import VisionConfig


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """Tokens of one image span: the aligner grid in reading order, a newline per row, start and end."""
    return n_llm_h * (n_llm_w + 1) + 2


@dataclass(frozen=True)
class ImagePlan:
    """Where one image lands: the pixel box it is resized into and the patch / LLM grids of that box."""

    height: int  # pixels, a multiple of patch_size
    width: int
    vit_h: int  # patch rows
    vit_w: int
    llm_h: int  # aligner rows
    llm_w: int

    @property
    def num_tokens(self) -> int:
        return num_image_tokens(self.llm_h, self.llm_w)

    @property
    def num_patches(self) -> int:
        return self.vit_h * self.vit_w


def _llm_grid(height: int, width: int, patch: int, ratio: int) -> tuple[int, int]:
    return math.ceil((height // patch) / ratio), math.ceil((width // patch) / ratio)


def _shrink(height: float, width: float, patch: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-preserving box whose grid fits ``max_tokens`` (the reference's closed form)."""
    aspect = height / width
    columns = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    rows = columns * aspect
    cell = patch * ratio
    if columns < 1.0:  # very tall: one column
        return (max_tokens - 2) // 2 * cell, cell
    if rows < 1.0:  # very wide: one row
        return cell, (max_tokens - 3) * cell
    beta = min(math.floor(columns) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * beta / patch) * patch, math.floor(width * beta / patch) * patch


def plan_image(width: int, height: int, config: VisionConfig) -> ImagePlan:
    """The resize plan of an image of ``width`` x ``height`` pixels (a pure function of its arguments)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size {width}x{height}: both sides must be positive")
    patch, ratio, max_tokens = config.patch_size, config.downsample_ratio, config.max_image_tokens
    if config.max_wh_ratio is not None and width > height * config.max_wh_ratio:
        width = height * config.max_wh_ratio
    if width * height < config.min_pixels:
        scale = (config.min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    box_w, box_h = math.ceil(width / patch) * patch, math.ceil(height / patch) * patch
    llm_h, llm_w = _llm_grid(box_h, box_w, patch, ratio)
    if num_image_tokens(llm_h, llm_w) > max_tokens:
        box_h, box_w = _shrink(height, width, patch, ratio, max_tokens)
        llm_h, llm_w = _llm_grid(box_h, box_w, patch, ratio)
        if num_image_tokens(llm_h, llm_w) > max_tokens:
            raise ValueError(f"image size {width}x{height}: the resize plan cannot fit {max_tokens} image tokens")
    return ImagePlan(box_h, box_w, box_h // patch, box_w // patch, llm_h, llm_w)
