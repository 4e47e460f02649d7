"""The ops seam: every op the models need is one name with a torch reference and optional faster backends.

A backend registers beside its op's reference with the devices and dtypes it serves and a check of whether it
can run here (Triton installed, a CUDA capability, a torch built-in present). :func:`resolve` picks, once per
model load, the highest-priority backend that serves the model's device and dtype, logs the choice, and returns
plain functions: the forward never asks the registry anything. The reference (priority 0) serves every device
and is the truth every other backend is tested against (``tests/ops``).

``DSINFER_OPS`` forces choices, e.g. ``DSINFER_OPS="routed_moe=reference,attention=reference"``; a name that
is not registered, or a backend that cannot serve the device, is an error rather than a silent fallback.

A faster backend that raises (a kernel that does not compile with this Triton, a launch beyond the device's
resources) degrades, never crashes: the op table's function logs a warning naming the op, the backend and the
error, and runs the reference for that call and every later call of the same setting (device, dtypes, ranks
and scalar arguments). Only a setting's first call degrades: once it has run, a later error is a real one.
Inside a CUDA graph capture the error propagates instead (the capture must not record a half-run kernel).
``Backend.fn`` stays the bare backend, which is what ``tests/ops`` checks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dsinfer import envs

logger = logging.getLogger(__name__)

REFERENCE = "reference"


@dataclass(frozen=True)
class Backend:
    op: str
    name: str
    fn: Callable
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None
    available: Callable[[], bool]
    priority: int
    guarded: Callable | None = None  # ``fn`` behind the fallback to the reference (the reference itself: ``fn``)

    def serves(self, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type not in self.devices:
            return False
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        return bool(self.available())


_REGISTRY: dict[str, dict[str, Backend]] = {}


def register(
    op: str,
    name: str,
    *,
    devices: tuple[str, ...] = ("cpu", "cuda"),
    dtypes: tuple[torch.dtype, ...] | None = None,
    available: Callable[[], bool] | None = None,
    priority: int | None = None,
) -> Callable[[Callable], Callable]:
    """Decorator: make ``fn`` backend ``name`` of ``op``. The reference must serve every device."""

    def decorate(fn: Callable) -> Callable:
        backends = _REGISTRY.setdefault(op, {})
        if name in backends and backends[name].fn is not fn:
            raise ValueError(f"op {op!r} already has a backend named {name!r}")
        rank = priority if priority is not None else (0 if name == REFERENCE else 10)
        guarded = fn if name == REFERENCE else falls_back_to_reference(op, name, fn)
        backends[name] = Backend(op, name, fn, tuple(devices), dtypes, available or (lambda: True), rank, guarded)
        return fn

    return decorate


def _setting(args: tuple, kwargs: dict) -> tuple:
    """What a kernel specialises on, roughly: each tensor's device, dtype and rank, and the hashable scalars; an
    op's argument object (a dataclass) counts as its fields, so it keys as the same arguments passed one by one."""

    def key(value):
        if isinstance(value, torch.Tensor):
            return (value.device.type, value.dtype, value.dim())
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return (type(value).__name__, *(key(getattr(value, f.name)) for f in dataclasses.fields(value)))
        return type(value).__name__

    return tuple(key(a) for a in args) + tuple((name, key(v)) for name, v in sorted(kwargs.items()))


def falls_back_to_reference(op: str, name: str, fn: Callable) -> Callable:
    """``fn`` that runs ``op``'s reference instead wherever it raised once (see the module docstring)."""
    failed: set[tuple] = set()
    ran: set[tuple] = set()  # settings that ran once: a later error there is a real one and propagates

    @functools.wraps(fn)
    def call(*args, **kwargs):
        setting = _setting(args, kwargs)
        reference = _REGISTRY[op][REFERENCE].fn
        if setting in failed:
            return reference(*args, **kwargs)
        if setting in ran:
            return fn(*args, **kwargs)
        try:
            out = fn(*args, **kwargs)
        except Exception as error:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            first_line = str(error).splitlines()[0] if str(error) else ""
            logger.warning("%s: the %s backend failed (%s: %s); running the torch reference for this setting",
                           op, name, type(error).__name__, first_line)  # fmt: skip
            failed.add(setting)
            return reference(*args, **kwargs)
        ran.add(setting)
        return out

    return call


def backends(op: str) -> list[Backend]:
    """Every backend registered for ``op``, best first."""
    _load_backends()
    if op not in _REGISTRY:
        raise KeyError(f"no op named {op!r}; registered: {sorted(_REGISTRY)}")
    return sorted(_REGISTRY[op].values(), key=lambda b: -b.priority)


def _forced() -> dict[str, str]:
    return dict(envs.OPS.get())


def choose(op: str, device: torch.device | str, dtype: torch.dtype, forced: str | None = None) -> Backend:
    """The backend ``op`` runs with on ``device`` / ``dtype``: the forced one, else the best that serves."""
    device = torch.device(device)
    candidates = backends(op)
    if forced is not None:
        match = [b for b in candidates if b.name == forced]
        if not match:
            raise ValueError(f"DSINFER_OPS asks {op}={forced}, but {op} has only {[b.name for b in candidates]}")
        if not match[0].serves(device, dtype):
            raise ValueError(f"DSINFER_OPS asks {op}={forced}, which cannot run on {device.type} / {dtype} here")
        return match[0]
    for backend in candidates:
        if backend.serves(device, dtype):
            return backend
    raise RuntimeError(f"op {op!r} has no backend for {device.type} / {dtype}")


@dataclass
class OpTable:
    """The functions one model calls, chosen once at load time (``ops.routed_moe(...)``)."""

    device: torch.device
    dtype: torch.dtype
    chosen: dict[str, Backend] = field(default_factory=dict)

    def __getattr__(self, op: str) -> Callable:
        chosen = self.__dict__.get("chosen", {})
        if op in chosen:
            backend = chosen[op]
            guarded = backend.guarded
            if guarded is not None and getattr(guarded, "__wrapped__", guarded) is backend.fn:
                return guarded
            return backend.fn  # a backend built by hand (tests): its own function, unguarded
        raise AttributeError(f"op table has no op {op!r}")

    def describe(self) -> str:
        return ", ".join(f"{op}={backend.name}" for op, backend in sorted(self.chosen.items()))


_resolved: dict[tuple, OpTable] = {}


def resolve(device: torch.device | str, dtype: torch.dtype) -> OpTable:
    """Choose every registered op's backend for one device and dtype and log the choices (once per setting)."""
    _load_backends()
    device = torch.device(device)
    key = (device, dtype, envs.OPS.get())
    if key not in _resolved:
        _resolved[key] = _choose_all(device, dtype)
    return _resolved[key]


def forget_choices() -> None:
    """Choose every setting's backends again at its next :func:`resolve` (a tool that changes which backends
    serve a device, as ``benchmarks/verify_op_count.py --kernels`` does, and restores them afterwards)."""
    _resolved.clear()


def _choose_all(device: torch.device, dtype: torch.dtype) -> OpTable:
    forced = _forced()
    unknown = set(forced) - set(_REGISTRY)
    if unknown:
        raise ValueError(f"DSINFER_OPS names unknown ops {sorted(unknown)}; registered: {sorted(_REGISTRY)}")
    table = OpTable(device, dtype)
    for op in sorted(_REGISTRY):
        table.chosen[op] = choose(op, device, dtype, forced.get(op))
    logger.info("ops on %s / %s: %s", device.type, dtype, table.describe())
    return table


_loaded = False


def _load_backends() -> None:
    """Import every op module once so their ``register`` calls have run."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import dsinfer.ops.catalog  # noqa: F401


def bind_ops(model: torch.nn.Module, table: OpTable) -> None:
    """Give every module of ``model`` that calls ops (it has an ``ops`` attribute) the chosen table."""
    for module in model.modules():
        if "ops" in vars(module):
            module.ops = table


def reference_table(device: torch.device | str, dtype: torch.dtype) -> OpTable:
    """Every op's torch reference, whatever the device: the differentiable choice (training)."""
    _load_backends()
    table = OpTable(torch.device(device), dtype)
    for op in sorted(_REGISTRY):
        table.chosen[op] = _REGISTRY[op]["reference"]
    return table
