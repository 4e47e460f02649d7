"""Image spans in the engine: which part of which image a step's rows hold, and the encoder outputs for them.

A prompt's image span is a run of the image token id; a prefill step may hold all of it, a part of it
(chunked prefill, or a replay after a prefix-cache hit), or none. :func:`image_pieces` finds, on the engine
thread, the pieces a step needs; :class:`ImageEmbeddings` runs on the device worker: it encodes the step's
images that it does not hold yet (all of them in one packed pass of the vision tower, across requests),
keeps recent encodings by content hash so the next chunk of a span (or the same picture in another request)
does not encode it again, and builds the step's :class:`~dsinfer.kv.batch.ImageSplice`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from dsinfer.images.inputs import ImageInput
from dsinfer.kv.batch import ImageSplice

DEFAULT_ENCODED_IMAGES_KEPT = 64


@dataclass(frozen=True)
class ImagePiece:
    """Rows ``[first, stop)`` of an image's span sit at batch rows starting at ``batch_row``."""

    image: ImageInput
    first: int
    stop: int
    batch_row: int


def check_image_spans(prompt_ids: list[int], images: tuple[ImageInput, ...], config) -> None:
    """Reject images the model cannot read or that do not sit on placeholder spans of this prompt."""
    if getattr(config, "vision", None) is None or config.image_token_id is None:
        raise ValueError("images: this model has no vision tower; it reads text only")
    previous_end = 0
    for index, image in enumerate(images):
        if image.offset < previous_end or image.end > len(prompt_ids):
            raise ValueError(
                f"images[{index}]: span [{image.offset}, {image.end}) overlaps another or leaves the prompt"
            )
        if any(token != config.image_token_id for token in prompt_ids[image.offset : image.end]):
            raise ValueError(f"images[{index}]: the prompt does not hold the image token id over the image's span")
        previous_end = image.end


def image_pieces(images: tuple[ImageInput, ...], start: int, count: int, batch_row: int) -> list[ImagePiece]:
    """The pieces of ``images`` inside positions ``[start, start + count)`` of a sequence packed at ``batch_row``."""
    pieces = []
    for image in images:
        first, stop = max(image.offset, start), min(image.end, start + count)
        if first < stop:
            pieces.append(ImagePiece(image, first - image.offset, stop - image.offset, batch_row + first - start))
    return pieces


class ImageEmbeddings:
    """The device side: encodes images through the model and remembers the latest encodings by content hash."""

    def __init__(self, model, kept: int = DEFAULT_ENCODED_IMAGES_KEPT) -> None:
        self.model = model
        self.kept = kept
        self.encoded: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.images_encoded = 0  # images that went through the tower (a test and metric hook)

    def splice(self, pieces: list[ImagePiece], device: torch.device) -> ImageSplice | None:
        if not pieces:
            return None
        missing: dict[str, ImageInput] = {}
        for piece in pieces:
            key = piece.image.content_hash
            if key in self.encoded:
                self.encoded.move_to_end(key)
            else:
                missing.setdefault(key, piece.image)
        if missing:
            for key, span in zip(missing, self.model.encode_images(list(missing.values())), strict=True):
                self.encoded[key] = span
            self.images_encoded += len(missing)
        spans = {piece.image.content_hash: self.encoded[piece.image.content_hash] for piece in pieces}
        while len(self.encoded) > max(self.kept, len(spans)):
            self.encoded.popitem(last=False)
        rows = torch.cat([torch.arange(p.batch_row, p.batch_row + p.stop - p.first) for p in pieces])
        values = torch.cat([spans[p.image.content_hash][p.first : p.stop] for p in pieces])
        return ImageSplice(rows.to(device), values)
