"""Run a test module's Triton cases in a fresh interpreter with ``TRITON_INTERPRET=1`` set before Triton loads,
so the reductions the kernels call (``tl.sum``, ``tl.max`` are Triton functions themselves) are interpreted too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import sys
sys.path.insert(0, {folder!r})
import {module} as cases
failures = cases.run_interpreted_cases()
print("\\n".join(failures) if failures else "ok")
"""


def assert_interpreted_cases_pass(module: str) -> None:
    """``module`` (a file beside this one) defines ``run_interpreted_cases() -> list[str]`` (failure messages)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = _SCRIPT.format(folder=str(Path(__file__).resolve().parent), module=module)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok", result.stdout[-3000:]
