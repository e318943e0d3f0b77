"""Read only the key/value metadata at the head of a GGUF file (no tensor infos, no weights).

`gguf.GGUFReader` also parses every tensor's description, which takes seconds on the default
model; sizing the KV cache needs a handful of integers from the header. Layout (GGUF v2/v3):
magic "GGUF", u32 version, u64 tensor count, u64 key/value count, then per pair: a string key
(u64 length + UTF-8), a u32 value type and the value. Arrays (the tokenizer's vocabulary) are
skipped without being kept.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    length = _read(f, "<Q")
    return f.read(length).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item_kind, count = _read(f, "<I"), _read(f, "<Q")
        if item_kind in _SCALARS and not keep:   # fixed size: jump over it
            f.seek(count * struct.calcsize(_SCALARS[item_kind]), 1)
            return None
        items = [_value(f, item_kind, keep) for _ in range(count)]
        return items if keep else None
    raise ValueError(f"unknown GGUF value type {kind}")


def read_gguf_metadata(path: str | Path, keep_arrays: bool = False) -> dict[str, Any]:
    """Every scalar and string metadata value (arrays only when keep_arrays)."""
    path = Path(path)
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
        _read(f, "<Q")   # tensor count: not needed
        metadata = {}
        for _ in range(_read(f, "<Q")):
            key = _string(f)
            value = _value(f, _read(f, "<I"), keep_arrays)
            if value is not None:
                metadata[key] = value
    return metadata
