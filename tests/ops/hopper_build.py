"""Compile a Triton kernel for sm_90 on any machine (no GPU) and read the cubin's register and stack use: the
build checks of ``tests/ops`` (spills, occupancy) run on the CPU with the installed Triton's own ptxas."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest


def compile_for_hopper(kernel, pointers: dict, constants: dict, options: dict, aligned: tuple[str, ...] = ()):
    """``kernel`` built for sm_90: ``pointers`` maps each ``*_ptr`` argument to its Triton type, upper-case
    arguments are the ``constants``, the rest 32-bit integers (``scale`` float32); pointers and the ``aligned``
    arguments are specialised as 16-divisible, as a launch on aligned tensors is."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name.isupper():
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if name.endswith("_ptr") or name in aligned
    }
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(cubin: bytes, flag: str) -> str | None:
    """Triton's bundled ``cuobjdump`` (or one on the PATH) run on ``cubin`` with ``flag``; None without the tool."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([tool, flag, handle.name], capture_output=True, text=True).stdout


def registers_and_stack(cubin: bytes) -> tuple[int, int] | None:
    """A thread's registers and stack bytes (register spills show as stack) of the cubin's kernel; None without
    ``cuobjdump``."""
    usage = cuobjdump(cubin, "-res-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage) if usage is not None else None
    return (int(found.group(1)), int(found.group(2))) if found else None


def register_spills(cubin: bytes) -> int | None:
    """Bytes of stack (register spills) of the cubin's kernel; None without ``cuobjdump``."""
    usage = registers_and_stack(cubin)
    return usage[1] if usage is not None else None
