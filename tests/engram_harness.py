"""What the Engram tests ask of this process's memory map: whether it still maps a given segment."""

from __future__ import annotations

from pathlib import Path

from dsinfer.engram.store import EngramStore


def maps_segment(store: EngramStore) -> bool:
    """Whether this process maps ``store``'s segment (an unlinked one shows as '<path> (deleted)').

    Matched by the file's inode as well as its path: segments of one checkpoint share a name, and another
    segment of that name still mapped here is another file.
    """
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)  # address, permissions, offset, device, inode, path
        if len(fields) == 6 and int(fields[4]) == store.inode and fields[5].startswith(str(store.path)):
            return True
    return False
