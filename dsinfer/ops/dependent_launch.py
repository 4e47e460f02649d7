"""Programmatic dependent launch (PDL, sm_90 and later): a kernel may start before the one ahead of it on the
stream has finished, do the work that does not read that kernel's outputs, then wait for it.

Two halves, both Triton jit functions taking a ``PDL`` constexpr (False: they compile to nothing, which is what
the interpreter and GPUs before sm_90 get):

* :func:`allow_dependents` lets the next kernel on the stream launch once every program of this one has called
  it (a hint; it never lets a dependent read early, since the dependent waits);
* :func:`wait_for_prerequisite` blocks until the kernel ahead has finished and its writes are visible.

A kernel launched with ``**launch_options(device)`` (``launch_pdl=True`` when on) must call
:func:`wait_for_prerequisite` in every program before it reads anything an earlier kernel wrote or writes
anything a later one reads, and before any early return: then a kernel that waits has also waited for
everything before the one ahead (that one ended after its own wait), so the order of the stream holds. Work
before the wait may read only what no kernel of the step writes: the weights. CUDA graphs keep the dependency
(a programmatic edge). It is on by default on sm_90+; ``DSINFER_PDL=0`` turns it off.

The kernels that launch as dependents are the FP8 GEMV (``fp8_linear`` at one token), whose first step's weight
loads run before its wait. The norms, RoPE, the RoPE angles, SwiGLU, the routed experts' GEMVs and the FP8 GEMV
let dependents launch. On the H200 the V4 slice with its FP8 linears kept decoded one request in 1.065 ms
against 1.082 without (docs/perf.md, pass 10); every graph stayed bit-identical to its eager step."""

from __future__ import annotations

import functools

import torch

from dsinfer import envs

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

DEFAULT_ON = envs.PDL.default


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch as programmatic dependents: a CUDA device of sm_90+, a Triton with
    grid dependency control, and ``DSINFER_PDL`` not ``0`` (unset: :data:`DEFAULT_ON`)."""
    if triton is None or device.type != "cuda":
        return False
    return envs.PDL.get() and _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Keyword arguments of a Triton launch that makes the kernel a programmatic dependent (empty when off)."""
    return {"launch_pdl": True} if dependent_launch(device) else {}


if triton is not None:

    @triton.jit
    def allow_dependents(PDL: tl.constexpr):
        """Let the next kernel on the stream launch (it still waits for this one to finish)."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def wait_for_prerequisite(PDL: tl.constexpr):
        """Wait until the kernel ahead on the stream has finished and its writes are visible."""
        if PDL:
            gdc_wait()
