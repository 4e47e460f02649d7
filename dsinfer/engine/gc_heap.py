"""Keep Python's cyclic garbage collector off the step's critical path in a process that owns an engine.

Loading a model and capturing its graphs leaves hundreds of thousands of long-lived Python objects (modules,
parameters, tensors, imported libraries). Every full collection walks all of them, and one can land inside any
decode step, since each step allocates small objects (lists, dicts, outputs) that trigger collections. As vLLM
does after its start-up, :func:`freeze_heap` collects once and then moves every object alive into the
permanent generation, which later collections skip: they walk only what was allocated since.

Only a process whose engine lives until it exits should stay frozen (``dsinfer serve``, an engine process); a
process that builds and drops engines (the benchmark sweep, one per point) thaws with :func:`thaw_heap` once
its timed steps are done, or the dropped engines' cycles would never be collected.
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Collect what is garbage now, then exempt every surviving object from later collections."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Return the frozen objects to the collector (the next ``gc.collect()`` sees them again)."""
    gc.unfreeze()
