"""The errors the Engram store raises: its messages say which file, segment or limit was at fault."""

__all__ = ["EngramMemoryError", "EngramStoreError"]


class EngramStoreError(RuntimeError):
    """The Engram segment could not be created, loaded or attached; the message says why."""


class EngramMemoryError(EngramStoreError):
    """The host has too little free shared memory for the Engram tables (checked before loading)."""
