"""Image parts of API requests -> the engine's :class:`~dsinfer.images.inputs.ImageInput` list, or a 400.

deepseek-recipe does the protocol work: it finds the image parts of Chat Completions (``image_url``),
Responses (``input_image``) and Anthropic Messages (``image`` blocks) while converting the body, records each
part's request location (``messages.0.content[1]``), and its resolver decodes data URLs, checks the format
(png, jpeg, webp, gif) and resizes into the V4.1 box. What is ours:

* **No fetching.** A remote URL is refused (the server reaches no network on a client's behalf); a data URL
  (``data:image/png;base64,...``) carries the image in the request.
* **Limits** (server flags): images per request, encoded bytes per image, source pixels per image (read
  from the header before anything is decoded, so a decompression bomb costs nothing).
* **Patches**: the resolver's pixels, checked to be at the box our plan (:mod:`dsinfer.images.plan`)
  computes from the source size, become normalised patches with a content hash for the prefix cache.

Every failure raises :class:`ImageRejected` (a ``ValueError``: the server answers 400) naming the part.
Nothing is sent to the engine before every image of the request has been read.
"""

from __future__ import annotations

import base64
import io
import logging
import urllib.parse
from dataclasses import dataclass

import deepseek_recipe as recipe

from dsinfer.config.vision import VisionConfig
from dsinfer.images.inputs import (
    ImageInput,
    content_hash,
    decode_rgb,
    fit_to_plan,
    image_from_pixels,
    pixels_of,
)
from dsinfer.images.plan import plan_image

logger = logging.getLogger(__name__)

DEFAULT_MAX_IMAGES = 16
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 32 * 1024 * 1024


class ImageRejected(ValueError):
    """A request's image cannot be used; the message names the part and says why."""


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = DEFAULT_MAX_IMAGES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        for name in ("max_images", "max_image_bytes", "max_image_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")


class ImageReader:
    """Reads the image sources of one converted request, for one served model's vision tower."""

    def __init__(self, vision: VisionConfig, limits: ImageLimits | None = None) -> None:
        self.vision = vision
        self.limits = limits or ImageLimits()
        fetcher = recipe.ReqwestImageFetcher.with_max_bytes(self.limits.max_image_bytes)
        # Remote URLs are refused before resolving; the filter is a second lock on the same door.
        fetcher = fetcher.with_destination_filter(lambda _host, _address: False)
        self.resolver = recipe.ImageResolver(fetcher, recipe.OpenCvImagePreprocessor())

    def read(self, sources: list[recipe.ImageSource]) -> list[ImageInput]:
        """Every source as model input, in placeholder order; raises :class:`ImageRejected`."""
        if len(sources) > self.limits.max_images:
            raise ImageRejected(
                f"{_where(sources[self.limits.max_images])}: the request has {len(sources)} images; "
                f"this server accepts at most {self.limits.max_images} per request (--max-images-per-request)"
            )
        originals = [self._source_bytes(source) for source in sources]
        try:
            resolved = self.resolver.resolve(sources, recipe.ImageQuota()).images
        except recipe.ImageError as exc:
            raise ImageRejected(str(exc)) from None
        except recipe.CalcResizeError as exc:
            raise ImageRejected(f"an image cannot be fitted into the model's image token budget ({exc})") from None
        return [
            self._to_input(source, data, info) for source, data, info in zip(sources, originals, resolved, strict=True)
        ]

    def _source_bytes(self, source: recipe.ImageSource) -> bytes:
        """The source's encoded bytes, after the checks that need no decoding: kind, size, header pixels."""
        where = _where(source)
        if source.kind == "url":
            raise ImageRejected(
                f"{where}: remote image URLs are not fetched by this server; send the image inline as a data URL "
                f"(data:image/png;base64,...)"
            )
        data = source.data if source.kind == "bytes" else _data_url_bytes(source.data_url, where)
        if not data:
            raise ImageRejected(f"{where}: the image is empty")
        if len(data) > self.limits.max_image_bytes:
            raise ImageRejected(
                f"{where}: the image has {len(data)} bytes; at most {self.limits.max_image_bytes} are accepted "
                f"(--max-image-bytes)"
            )
        width, height = _header_size(data, where)
        if width * height > self.limits.max_image_pixels:
            raise ImageRejected(
                f"{where}: the image has {width}x{height} pixels; at most {self.limits.max_image_pixels} are "
                f"accepted (--max-image-pixels)"
            )
        return data

    def _to_input(self, source: recipe.ImageSource, data: bytes, info: recipe.ImageInfo) -> ImageInput:
        where = _where(source)
        original = _header_size(data, where)
        plan = plan_image(*original, self.vision)
        try:
            resolved = decode_rgb(info.data)
        except ValueError as exc:
            raise ImageRejected(f"{where}: {exc}") from None
        if resolved.size != (plan.width, plan.height):
            # The library planned another box (a different version, or a cap we do not share): fit ours.
            logger.warning("image %s: resolver gave %s, plan %dx%d", where, resolved.size, plan.width, plan.height)
            resolved = fit_to_plan(decode_rgb(data), plan, self.vision)
        return image_from_pixels(pixels_of(resolved), plan, self.vision, content_hash(data, plan))


def _where(source: recipe.ImageSource) -> str:
    return source.path or "image"


def _data_url_bytes(url: str, where: str) -> bytes:
    """The body of a ``data:`` URL (base64 or percent-encoded)."""
    head, comma, body = url.partition(",")
    if not comma or not head.startswith("data:"):
        raise ImageRejected(f"{where}: expected a data URL (data:image/...;base64,...)")
    try:
        if head.endswith(";base64"):
            return base64.b64decode(body, validate=False)
        return urllib.parse.unquote_to_bytes(body)
    except ValueError:
        raise ImageRejected(f"{where}: the data URL's base64 body is malformed") from None


def _header_size(data: bytes, where: str) -> tuple[int, int]:
    """Width and height from the image header (Pillow reads no pixel data here)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Image.DecompressionBombError as exc:
        raise ImageRejected(f"{where}: the image has too many pixels ({exc})") from None
    except UnidentifiedImageError:
        raise ImageRejected(f"{where}: the image cannot be decoded (expected png, jpeg, webp or gif data)") from None
    except OSError as exc:
        raise ImageRejected(f"{where}: the image cannot be decoded ({exc})") from None
