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



def brief(value: object, limit: int = 60) -> str:
    """`repr(value)`, cut to about `limit` characters, for messages about untrusted input: a
    60 MB string, a million-digit integer or a deeply nested list is never formatted whole."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, (str, bytes)):
        return repr(value[:limit]) + ("…" if len(value) > limit else "")
    if isinstance(value, (list, tuple, dict)):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
        if len(items) > 8 or not all(_is_short_scalar(v) for v in items):
            return f"<a {type(value).__name__} of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _is_short_scalar(value: object) -> bool:
    if isinstance(value, (str, bytes)):
        return len(value) <= 20
    if isinstance(value, int):
        return value.bit_length() <= 128
    return value is None or isinstance(value, float)


def shorten(text: str, limit: int = 200) -> str:
    """`text` on one line, cut to `limit` characters (for exception messages shown to users)."""
    text = " ".join(text[:limit * 2].split())
    return text if len(text) <= limit else text[:limit] + "…"
