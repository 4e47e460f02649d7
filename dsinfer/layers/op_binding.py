"""Which op table a layer calls: the one its model resolved when it was built.

A model's constructor takes the op table resolved once for its device and dtype (the loaders pass
``resolve(device, dtype)``: the registry's choice, ``DSINFER_OPS`` included) and binds it to every layer that
calls ops; no layer chooses a backend itself. A layer built on its own, and a model built without a table, run
every op's torch reference: the truth, and what the registry chooses on the CPU anyway.
"""

from __future__ import annotations

import functools

import torch

from dsinfer.ops.registry import OpTable, reference_table


@functools.cache
def reference_ops() -> OpTable:
    """Every op's torch reference (each serves every device and dtype): the table a layer starts with."""
    return reference_table("cpu", torch.float32)
