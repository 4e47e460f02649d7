"""``vision_attention``: every backend against block-diagonal softmax attention written out by hand."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.registry import backends


def block_diagonal_attention(q, k, v, lengths):
    """softmax(q k^T / sqrt(d)) v over the whole packed batch, with a mask that keeps images apart."""
    image = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k.double()) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(image[:, None] != image[None, :], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v.double()).to(q.dtype)


@pytest.mark.parametrize("lengths", [[7], [3, 5, 1], [16, 2]])
def test_backends_keep_images_apart(lengths):
    gen = torch.Generator().manual_seed(len(lengths))
    q, k, v = (torch.randn(sum(lengths), 4, 8, generator=gen) for _ in range(3))
    want = block_diagonal_attention(q, k, v, lengths)
    for backend in backends("vision_attention"):
        if backend.serves(torch.device("cpu"), torch.float32):
            torch.testing.assert_close(backend.fn(q, k, v, lengths), want, rtol=1e-5, atol=1e-5)


def test_lengths_must_cover_the_batch():
    q = torch.zeros(5, 1, 4)
    with pytest.raises(ValueError, match="image lengths sum to 4, the packed batch holds 5 patches"):
        backends("vision_attention")[-1].fn(q, q, q, [4])
