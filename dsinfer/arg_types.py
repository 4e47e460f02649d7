"""argparse value types shared by every ``dsinfer`` subcommand, so flags fail with the same clear message."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1; anything else is an argparse error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value
