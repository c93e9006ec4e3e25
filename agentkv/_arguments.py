"""argparse types of the command line: a number in range, or a one-line usage error."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Collection
from typing import TypeVar

__all__ = ["at_least", "list_of", "names_from", "port_number"]

N = TypeVar("N", int, float)


def at_least(cast: Callable[[str], N], minimum: float, *, strict: bool = False) -> Callable[[str], N]:
    """A finite ``cast`` (int or float) >= ``minimum`` (> with ``strict``; -inf: any finite number)."""
    kind = "an integer" if cast is int else "a number"

    def parse(text: str) -> N:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            bound = "" if minimum == -math.inf else f" {'>' if strict else '>='} {minimum:g}"
            raise argparse.ArgumentTypeError(f"must be {kind if cast is int else 'a finite number'}{bound}, "
                                             f"got {text!r}")
        return value

    return parse


def port_number(text: str) -> int:
    """A TCP port, 1 to 65535."""
    port = at_least(int, 1)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1 to 65535), got {text!r}")
    return port


def list_of(item: Callable[[str], N]) -> Callable[[str], list[N]]:
    """A non-empty comma-separated list of ``item`` values."""

    def parse(text: str) -> list[N]:
        values = [item(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"no values in {text!r}")
        return values

    return parse


def names_from(choices: Collection[str], what: str) -> Callable[[str], list[str]]:
    """A non-empty comma-separated list of names, each one of ``choices`` (``what`` names them)."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {', '.join(choices)}")
        return names

    return parse
