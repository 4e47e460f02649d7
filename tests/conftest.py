"""Shared fixtures: tiny checkpoints written once per test session, in the real file formats."""

from __future__ import annotations

import pytest
import torch

from dsinfer.models.tiny import make_tiny_checkpoint


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (tiny matmuls: more threads only add contention), then as it was. Modules
    of tiny-model tests take it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture
def swapped_beside():
    """A factory of stand-ins for ``dsinfer.ops.side_stream.beside`` that run the main chain first and the side
    chain after it, each recording the step's token count in the list it is given. Where the two chains are
    independent (what running them on two streams needs) results stay bit-identical; a side chain that read the
    main chain's outputs, or wrote what the main chain reads, would change them."""

    def make(calls: list[int]):
        def run(side_work, main_work, x):
            calls.append(x.shape[0])
            main = main_work()
            return side_work(), main

        return run

    return make
