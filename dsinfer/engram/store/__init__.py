"""Engram tables in one POSIX shared-memory segment per host, mapped by every local rank.

DeepSeek-V4.1 has two Engram tables (layers 1 and 14) of 384,006,168 and 384,016,682 rows. A row is
256 FP8 e4m3 bytes plus 8 ue8m0 scale bytes (one power-of-two scale per 32 channels: the Hugging Face
reference's ``DeepseekV41EngramEmbedding.scale`` is ``[num_embeddings, head_dim // 32]``), stored as
two checkpoint tensors ``layers.L.engram.embed.weight`` (F8_E4M3 ``[rows, 256]``) and
``layers.L.engram.embed.scale`` (F8_E8M0 ``[rows, 8]``). Together about 203 GB: one copy per host,
not one per rank.

**Who loads.** The lowest local rank creates the segment (``O_EXCL``), checks memory, reserves it
with ``posix_fallocate`` (so running out of memory is an error now, not a SIGBUS later), fills it
and sets the header state to ready. The other ranks poll for the file and the ready state, with a
timeout, and fail at once with the loader's message if it reports failure or dies.

**Cleanup: no leaked names.** A tmpfs/hugetlbfs file lives until its name is unlinked *and* the
last mapping and descriptor are gone; mappings vanish with their process however it ends, so only
the *name* can leak. Every path removes it:

1. *Early unlink.* The rank whose attach completes the expected count (the loader itself when it
   is alone) unlinks the name right away. From then on nothing can leak: the kernel frees the
   memory when the last rank unmaps or dies, SIGKILL included.
2. *Loader exits before that* (normal exit, exception): :meth:`EngramStore.close`, called by the
   context manager and by an ``atexit`` hook, unlinks the name; a failed load does so before
   re-raising, after writing its error into the header for the waiting ranks.
3. *Loader dies without running Python code* (SIGKILL, OOM killer, segfault): a reaper process,
   started next to the segment before any byte is loaded, holds the read end of a pipe whose
   write end only the loader has. The kernel closes that end when the loader dies; the reaper
   sees end-of-file and unlinks the name (only if it still names the same inode). It also exits
   on its own once the name is gone. It runs ``python -I -S`` on a few lines of stdlib code, in its
   own session so a signal to the job's process group does not take it along.
4. *An attaching rank dies* before attaching: the count never completes, the name stays until the
   loader exits (2 or 3). After attaching: nothing to do (1).

What is *not* covered: the loader and the reaper both killed before the early unlink (say
``kill -9`` of every process of the user), or processes forked from the loader that keep the pipe
open. :func:`remove_stale_segments` (``python -c "from dsinfer.engram.store import
remove_stale_segments; remove_stale_segments()"``) removes segments whose loader is dead, and a
loader replaces a same-named segment whose loader is dead.

**Modules.** :mod:`~dsinfer.engram.store.segment` lays out the segment (header, table directory,
record regions); :mod:`~dsinfer.engram.store.sources` reads tables from checkpoint shards or makes
random ones; :mod:`~dsinfer.engram.store.memory` checks free memory and picks ``/dev/shm`` or
hugetlbfs; :mod:`~dsinfer.engram.store.reaper` removes the names of dead loaders' segments;
:mod:`~dsinfer.engram.store.store` holds :class:`EngramStore`, which creates, loads, attaches and
closes. :mod:`~dsinfer.engram.store.errors` has the two errors.

This package imports only the standard library at import time (numpy when a source fills a table,
torch only inside the methods that hand out tensors), so helper processes start in milliseconds.
"""

from dsinfer.engram.store.errors import EngramMemoryError, EngramStoreError
from dsinfer.engram.store.memory import HUGETLBFS_ENV, SHM_DIR, available_shared_memory
from dsinfer.engram.store.reaper import remove_stale_segments
from dsinfer.engram.store.segment import (
    ENGRAM_ROW_BYTES,
    ENGRAM_SCALE_BLOCK,
    HUGE_PAGE_BYTES,
    EngramTableLayout,
    EngramTableSpec,
    segment_bytes,
    table_records,
)
from dsinfer.engram.store.sources import EngramSource, RandomEngramSource, SafetensorsEngramSource
from dsinfer.engram.store.store import ATTACH_TIMEOUT_ENV, EngramStore, default_segment_name

__all__ = [
    "ATTACH_TIMEOUT_ENV",
    "ENGRAM_ROW_BYTES",
    "ENGRAM_SCALE_BLOCK",
    "HUGETLBFS_ENV",
    "HUGE_PAGE_BYTES",
    "SHM_DIR",
    "EngramMemoryError",
    "EngramSource",
    "EngramStore",
    "EngramStoreError",
    "EngramTableLayout",
    "EngramTableSpec",
    "RandomEngramSource",
    "SafetensorsEngramSource",
    "available_shared_memory",
    "default_segment_name",
    "remove_stale_segments",
    "segment_bytes",
    "table_records",
]
