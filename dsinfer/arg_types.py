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


def non_negative_number(text: str, unit: str) -> float:
    """A finite number >= 0 of ``unit`` (seconds, GiB); anything else is an argparse error naming the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of {unit}, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be {unit} >= 0, got {text}")
    return value
