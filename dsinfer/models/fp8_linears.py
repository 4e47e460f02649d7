"""Block-scaled FP8 linears of a checkpoint: kept as stored (:class:`~dsinfer.layers.fp8_linear.Fp8Linear`) or
dequantised to the compute dtype on load, by policy.

``keep`` holds half the bytes of bf16; ``dequantize`` is what Hopper servers do when no fused FP8 kernel beats a
bf16 GEMM at the shapes served. docs/perf.md records the measurement behind the default.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from dsinfer import envs
from dsinfer.layers.fp8_linear import Fp8Linear
from dsinfer.ops.quant import quantize_fp8_blockwise

FP8_LINEAR_POLICIES = ("keep", "dequantize")
# Measured on the H200 (docs/perf.md, pass 8): kept as codes, the linears run the ``fp8_linear`` Triton
# kernels. The V4 slice then decodes one request 4.8% faster (1.112 against 1.168 ms), 32 requests level, and
# prefills 1.7% slower; the V4.1 slice decodes 3% slower. So CUDA dequantises once on load, as Hopper servers do,
# and ``keep`` is there for memory (the release's bytes exactly). Elsewhere memory is the scarcer resource.
DEFAULT_FP8_LINEARS = {"cuda": "dequantize"}
DEFAULT_FP8_LINEARS_ELSEWHERE = "keep"
# Weights that are FP8 in a checkpoint but are not linear layers (the Engram tables are kept their own way).
_NOT_A_LINEAR = re.compile(r"engram\.embed\.weight$")


def resolve_fp8_linears(policy: str | None, device: torch.device | str = "cpu") -> str:
    """The policy asked for, else ``$DSINFER_FP8_LINEARS``, else the device's default; anything else is an error."""
    default = DEFAULT_FP8_LINEARS.get(torch.device(device).type, DEFAULT_FP8_LINEARS_ELSEWHERE)
    chosen = policy or envs.FP8_LINEARS.get() or default
    if chosen not in FP8_LINEAR_POLICIES:
        raise ValueError(f"fp8_linears: expected one of {list(FP8_LINEAR_POLICIES)}, got {chosen!r}")
    return chosen


class Fp8LinearCollector:
    """FP8 linear weights as the loader reads them, installed as :class:`Fp8Linear` once the model has memory."""

    def __init__(self, policy: str, block: tuple[int, int], dtype: torch.dtype, stored: dict) -> None:
        self.policy, self.block, self.dtype, self.stored = policy, block, dtype, stored
        self._kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def wants(self, name: str, item, target: torch.Tensor) -> bool:
        """Keep this tensor as FP8: the policy says so, it is a 2-D FP8 ``.weight`` with a scale."""
        if self.policy != "keep" or not name.endswith(".weight") or _NOT_A_LINEAR.search(name):
            return False
        if item.dtype != "F8_E4M3" or target.dim() != 2:
            return False
        base = item.key[: -len(".weight")]
        return any(base + suffix in self.stored for suffix in (".scale", ".weight_scale_inv"))

    def take(self, name: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
        self._kept[name] = (codes, scale)

    def collected_names(self) -> set[str]:
        return set(self._kept)

    def drop_modules(self, model: nn.Module) -> None:
        """Replace each kept linear by a placeholder so the model never allocates its dequantised weight."""
        for name in self._kept:
            parent, child = _parent(model, name)
            setattr(parent, child, nn.Identity())

    def install(self, model: nn.Module, device: torch.device | str) -> None:
        for name, (codes, scale) in self._kept.items():
            parent, child = _parent(model, name)
            linear = Fp8Linear(codes.to(device), scale.to(device), self.block, self.dtype, ops=model.ops)
            setattr(parent, child, linear)
        self._kept.clear()


@torch.no_grad()
def keep_as_fp8_(model: nn.Module, is_fp8: Callable[[str], bool], block: tuple[int, int], dtype: torch.dtype) -> int:
    """Quantise in place each plain linear whose weight's name ``is_fp8`` (the release's FP8 linears) to an
    :class:`Fp8Linear` of its block-scaled codes: what the loader's ``keep`` makes of a checkpoint, for models
    built with random weights and no checkpoint. Returns how many linears it replaced."""
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear and is_fp8(f"{name}.weight")]
    for name in names:
        parent, child = _parent(model, f"{name}.weight")
        weight = getattr(parent, child).weight
        codes, scale = quantize_fp8_blockwise(weight.float(), block)
        setattr(parent, child, Fp8Linear(codes, scale, block, dtype, ops=model.ops))
    return len(names)


def _parent(model: nn.Module, weight_name: str) -> tuple[nn.Module, str]:
    path = weight_name[: -len(".weight")]
    parent_path, _, child = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), child
