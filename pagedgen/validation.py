"""Argument checks shared by the API, the engine and the memory tools.

One spelling of "an integer, at least this much" instead of a private copy per module; the
error names the argument and shows the value. No imports: the torch-free engine modules use it.
"""
from __future__ import annotations

from collections.abc import Callable


def is_int(value: object) -> bool:
    """An int that is not a bool (bool is an int subclass; True as a count is a mistake)."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(name: str, value: object, minimum: int = 1) -> int:
    """`value` if it is an integer >= minimum, else ValueError naming `name`."""
    if not is_int(value) or value < minimum:
        wanted = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return value


def int_at_least(minimum: int) -> Callable[[object], int]:
    """A field check for config keys and request lines: returns the value or raises
    ValueError("must be an integer >= N"); the caller adds the field's name and source."""
    def check(value: object) -> int:
        if not is_int(value) or value < minimum:
            raise ValueError(f"must be an integer >= {minimum}")
        return value
    return check
