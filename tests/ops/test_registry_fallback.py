"""A faster backend that raises degrades to its op's reference with one warning per setting, never a crash."""

from __future__ import annotations

import logging

import pytest
import torch

from dsinfer.ops import registry
from dsinfer.ops.registry import REFERENCE, OpTable, falls_back_to_reference


@pytest.fixture
def fake_op(monkeypatch):
    """An op ``scale_rows`` with a reference and a backend that cannot compile for float64."""
    calls = {"backend": 0}

    def reference(x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    def backend(x: torch.Tensor, factor: float) -> torch.Tensor:
        calls["backend"] += 1
        if x.dtype == torch.float64:
            raise RuntimeError("CompilationError: fp64 dot is not supported\nlong compiler log")
        if bool((x < 0).any()):
            raise RuntimeError("illegal memory access")  # a run-time fault, not a compile failure
        return x * factor

    ops = {REFERENCE: registry.Backend("scale_rows", REFERENCE, reference, ("cpu",), None, lambda: True, 0, reference)}
    monkeypatch.setitem(registry._REGISTRY, "scale_rows", ops)
    guarded = falls_back_to_reference("scale_rows", "fast", backend)
    table = OpTable(torch.device("cpu"), torch.float32)
    table.chosen["scale_rows"] = registry.Backend("scale_rows", "fast", backend, ("cpu",), None, lambda: True, 10,
                                                  guarded)  # fmt: skip
    return table, backend, calls


def test_a_failing_backend_runs_the_reference_and_says_so_once(fake_op, caplog):
    table, backend, calls = fake_op
    x = torch.arange(6, dtype=torch.float64).view(2, 3)
    with caplog.at_level(logging.WARNING, logger="dsinfer.ops.registry"):
        first = table.scale_rows(x, 2.0)
        second = table.scale_rows(x + 1, 2.0)
    assert torch.equal(first, x * 2) and torch.equal(second, (x + 1) * 2)
    assert calls["backend"] == 1  # the setting that failed goes straight to the reference afterwards
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "scale_rows: the fast backend failed (RuntimeError: CompilationError: fp64 dot is not supported); "
        "running the torch reference for this setting"
    ]
    assert torch.equal(table.scale_rows(x.float(), 3.0), x.float() * 3)  # another setting still uses the backend
    assert calls["backend"] == 2


def test_the_bare_backend_still_raises(fake_op):
    """tests/ops check Backend.fn: a broken kernel must fail there, not hide behind the reference."""
    table, backend, _ = fake_op
    with pytest.raises(RuntimeError, match="CompilationError"):
        table.chosen["scale_rows"].fn(torch.zeros(2, dtype=torch.float64), 2.0)


def test_every_registered_fast_backend_is_guarded():
    registry._load_backends()
    for op, found in registry._REGISTRY.items():
        for name, backend in found.items():
            if name == REFERENCE:
                assert backend.guarded is backend.fn, op
            else:
                assert backend.guarded is not backend.fn and backend.guarded.__wrapped__ is backend.fn, (op, name)


def test_an_error_after_a_setting_ran_once_is_a_real_one(fake_op):
    table, _, calls = fake_op
    x = torch.ones(3)
    assert torch.equal(table.scale_rows(x, 2.0), x * 2)  # float32: the backend compiles and runs
    with pytest.raises(RuntimeError, match="illegal memory access"):
        table.scale_rows(-x, 2.0)  # the same setting faults later: not hidden behind the reference
    assert calls["backend"] == 2


def test_an_argument_object_keys_as_its_fields():
    """An op's argument object keys its setting by its tensors' dtypes and its scalars, as loose arguments do."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class ScaleInputs:
        x: torch.Tensor
        factor: float

    half, double = torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.float64)
    assert registry._setting((ScaleInputs(half, 2.0),), {}) == registry._setting((ScaleInputs(half * 3, 2.0),), {})
    assert registry._setting((ScaleInputs(half, 2.0),), {}) != registry._setting((ScaleInputs(double, 2.0),), {})
    assert registry._setting((ScaleInputs(half, 2.0),), {}) != registry._setting((ScaleInputs(half, 3.0),), {})
