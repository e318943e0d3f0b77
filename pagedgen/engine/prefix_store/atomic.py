"""Write a file whole or not at all: a unique temporary name in the same folder, then rename.

Readers of the final name see the old file, no file, or the new file whole; two processes
writing the same name at once both succeed and one of the (identical) files wins.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterable
from pathlib import Path

_counter = itertools.count()


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_counter)}.tmp")


def write_atomically(path: Path, data: bytes | Iterable[bytes | memoryview]) -> int:
    """Returns the bytes written; on error nothing is left behind and the error is raised."""
    parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.writelines(parts)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return sum(len(p) for p in parts)
