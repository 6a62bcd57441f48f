"""argparse value types shared by the console script's subcommands.

A leaf: ``cli`` imports the subcommand modules (``check``, ``doctor``), so what they share cannot
live in ``cli`` without an import cycle.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["positive_int"]


def positive_int(flag: str, example: int) -> Callable[[str], int]:
    """An argparse ``type`` for counts: the message names the flag, the value and a value that works."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= 1, got {text!r}; e.g. {flag} {example}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}; e.g. {flag} {example}")
        return value

    return parse
