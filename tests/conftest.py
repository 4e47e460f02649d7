"""Shared fixtures: tiny checkpoints written once per test session, in the real file formats."""

from __future__ import annotations

import pytest
import torch

from dsinfer.models.tiny import make_tiny_checkpoint


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The embedded-default-sized V4 checkpoint: FP8 / FP4 weights, three shards, real tokenizer."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-v4"), seed=0)


@pytest.fixture(scope="session")
def tiny_v41_checkpoint(tmp_path_factory):
    """A tiny V4.1 checkpoint with every layer role, Engram on, DSpark stages: FP8 32x32 / FP4, real tokenizer."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-v41"), seed=0, arch="v41")


@pytest.fixture(scope="session")
def tiny_v41_vision_checkpoint(tmp_path_factory):
    """The tiny V4.1 checkpoint with a tiny vision tower (``vision.*``, ``aligner.*``, ``image_*`` tensors)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-v41-vision"), seed=0, arch="v41", vision=True)


@pytest.fixture(scope="module")
def tiny_v4_model(tiny_checkpoint):
    """The tiny V4 checkpoint loaded in fp32 (one per test module: some tests change its weights)."""
    from dsinfer.models.loader import load_model

    return load_model(tiny_checkpoint, progress=False)


@pytest.fixture(scope="session")
def tiny_v4_tokenizer(tiny_checkpoint):
    from dsinfer.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_checkpoint)
