"""Shared fixtures: tiny checkpoints written once per test session, in the real file formats."""

from __future__ import annotations

import os

import pytest
import torch

from dsinfer.models.tiny import make_tiny_checkpoint


def _share_the_cpus_between_workers() -> None:
    """Under pytest-xdist, each worker's torch takes its share of the CPUs (at least one thread), and so do the
    processes its tests start (engine and rank processes, the Triton interpreter's), through ``OMP_NUM_THREADS``.
    By default every worker would take a thread per core: on two cores two workers' OpenMP pools then wait on each
    other's descheduled threads at every tiny parallel op, and engine tests ran 5-30 times slower than alone. An
    ``OMP_NUM_THREADS`` set by the caller is left alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cpus // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(min(threads, torch.get_num_threads()))


_share_the_cpus_between_workers()


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
