"""The kinds of value a setting takes, each with its check: value -> normalised value, or
ValueError(requirement). The requirement reads after the setting's name ("must be an integer
>= 1"); each surface (LLM, YAML, a flag) adds the name and where the value came from.

Torch-free (it imports only the leaf validation.py): the CLI, the YAML loader and LLM() all check
through here.
"""
from __future__ import annotations

import os
import re
from typing import Any

from pagedgen.validation import is_int

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def integer(value: Any, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise ValueError(f"must be an integer >= {minimum}")
    return value


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def choice(value: Any, choices: tuple[str, ...]) -> str:
    """A torch.dtype is taken by its name (torch.float32 -> "float32"), so LLM(dtype=...)
    accepts both spellings without this module importing torch."""
    if type(value).__module__ == "torch" and str(value).startswith("torch."):
        value = str(value).removeprefix("torch.")
    if value not in choices:
        raise ValueError(f"must be one of {', '.join(choices)}")
    return value


def device(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ValueError("must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return value


def path(value: Any) -> str:
    """A file or folder name; a pathlib.Path is taken as its string."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not (isinstance(value, str) and value):
        raise ValueError("must be a non-empty string or null")
    return value


def size(value: Any) -> int:
    """Bytes from an integer or a string such as '2GiB', '512 MiB', '1.5GB'."""
    if is_int(value) and value > 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    unit = match and _SIZE_UNITS.get(match.group(2).lower())
    if not unit or float(match.group(1)) <= 0:
        raise ValueError("must be a positive size such as '2GiB', '512MiB' or a number of bytes")
    return int(float(match.group(1)) * unit)
