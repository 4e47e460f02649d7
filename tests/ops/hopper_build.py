"""Compile a Triton kernel for sm_90 on any machine (no GPU) and read the cubin's register and stack use: the
build checks of ``tests/ops`` (spills, occupancy) run on the CPU with the installed Triton's own ptxas."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest


def compile_for_hopper(kernel, pointers: dict, constants: dict, options: dict, aligned: tuple[str, ...] = ()):
    """``kernel`` built for sm_90: ``pointers`` maps each ``*_ptr`` argument to its Triton type, upper-case
    arguments are the ``constants``, the rest 32-bit integers (``scale`` float32); pointers and the ``aligned``
    arguments are specialised as 16-divisible, as a launch on aligned tensors is. Returns (triton, compiled)."""
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
    return triton, triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def registers_and_stack(triton, compiled) -> tuple[int, int] | None:
    """A thread's registers and stack bytes (register spills show as stack); None where Triton ships no
    ``cuobjdump``."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        usage = subprocess.run([str(tool), "-res-usage", handle.name], capture_output=True, text=True).stdout
    registers, stack = (int(value) for value in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    return registers, stack
