"""The Engram gather kernel's old address: the module lives in the ops seam (:mod:`dsinfer.ops.engram_gather.kernel`).

This name is the same module object (not a copy), so callers and tests that patch it patch the kernel's module.
"""

import sys

from dsinfer.ops.engram_gather import kernel

sys.modules[__name__] = kernel
