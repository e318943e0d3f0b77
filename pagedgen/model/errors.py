"""ModelLoadError: the one error type for a model that cannot be used, naming file and reason.

Loading reads files a user downloaded, converted or edited: truncated weights, a config.json
with a list at the top or a vocab_size of 10^12, a hand-made GGUF header. Each of these must
end as this ValueError (the CLI's "bad input before generating", exit 2), never as a raw
struct/json/safetensors traceback or a MemoryError after a huge allocation.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class ModelLoadError(ValueError):
    """A model file cannot be used; `path` is the file (or folder) and `reason` says why."""

    def __init__(self, reason: str, path: Path | str | None = None) -> None:
        self.reason, self.path = reason, path
        super().__init__(self._message())

    def _message(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason

    def naming(self, path: Path | str) -> "ModelLoadError":
        """The same error, naming `path` when no file was named yet."""
        if self.path is None:
            self.path = path
            self.args = (self._message(),)
        return self


# What reading a malformed file raises in the parsers underneath (json, struct, numpy,
# safetensors, transformers). Anything else is a bug of ours and stays a traceback.
_FILE_CONTENT_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, OSError, struct.error, KeyError, IndexError, TypeError, ArithmeticError,
    RecursionError)


def _safetensors_error() -> tuple[type[BaseException], ...]:
    try:
        from safetensors import SafetensorError
    except ImportError:  # older safetensors: its errors are plain Exceptions we cannot name
        return ()
    return (SafetensorError,)


@contextmanager
def load_errors_named(path: Path | str) -> Iterator[None]:
    """Turns any failure of reading the model at `path` into a ModelLoadError naming it."""
    try:
        yield
    except ModelLoadError as error:
        raise error.naming(path)
    except _FILE_CONTENT_ERRORS + _safetensors_error() as error:
        raise ModelLoadError(_reason(error), path) from error


def _reason(error: BaseException) -> str:
    text = (str(error).splitlines() or [""])[0][:300]
    if isinstance(error, ValueError) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
