"""Writing and reading JSONL files in the CLI tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, lines: list) -> Path:
    """One line per item: bytes as given (to test broken lines), anything else as JSON."""
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                              for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file; none when it does not exist."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
