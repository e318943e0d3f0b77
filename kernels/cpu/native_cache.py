"""Where the compiled kernel library lives, and why a file found there can be trusted.

The library's name is a hash of public data (sources, flags, CPU), so anyone able to write
to the cache folder could put a library of their own at that exact path, and loading a
library runs its constructors. Three rules close that:

- the folder is private: created 0700, and a cache folder (or its kernels/ subfolder) owned
  by another user or writable by group or others is not used (one warning; the library is
  then built in a private temporary folder for this process);
- every file is written to a temporary name and renamed into place, so no process ever sees
  half a library;
- next to each library, a sidecar file records the sha256 of the bytes the build produced.
  A library whose bytes do not match (corrupt, truncated, replaced, or left by a build that
  recorded nothing) is rebuilt before it is ever loaded.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

DIGEST_SUFFIX = ".sha256"


class UnsafeCacheError(OSError):
    """The cache folder could be written by someone else: its files cannot be trusted."""


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDGEN_CACHE_DIR", Path.home() / ".cache" / "pagedgen"))


def private_folder(root: Path) -> Path:
    """root/kernels, created 0700 where missing; UnsafeCacheError when root or it may be
    written by another user."""
    folder = root / "kernels"
    for path in (root, folder):
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(path)
    return folder


def _check_private(path: Path) -> None:
    problem = privacy_problem(path)
    if problem is not None:
        raise UnsafeCacheError(f"{path} {problem}")


def privacy_problem(path: Path) -> str | None:
    """Why `path` is not a folder only this user can write to, or None. Shared by every cache
    whose files are trusted once written (this one, the prefix store): a checksum proves a
    file whole, not who wrote it."""
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"is owned by another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "others" if info.st_mode & stat.S_IWOTH else "its group"
        return f"is writable by {who} (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def temporary_private_folder() -> Path:
    """A fresh 0700 folder for this process only, removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="pagedgen-kernels-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def digest_path(library: Path) -> Path:
    return library.with_name(library.name + DIGEST_SUFFIX)


def is_verified(library: Path) -> bool:
    """True when `library` holds exactly the bytes its build recorded."""
    try:
        recorded = digest_path(library).read_text().strip()
        return bool(recorded) and file_digest(library) == recorded
    except OSError:
        return False


def build_verified(library: Path, build: Callable[[Path], None]) -> None:
    """build(temporary path) writes the library; it is then moved into place and its digest
    recorded, both by rename (atomic: concurrent processes see the old file or the new one)."""
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        build(Path(tmp))
        digest = file_digest(Path(tmp))
        os.replace(tmp, library)
        _write_atomically(digest_path(library), digest + "\n")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".write-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_folder() -> Path:
    """Where a native library is built and cached: the private cache folder, or (one warning)
    a private folder for this process when the configured one could be written by someone
    else."""
    try:
        return private_folder(cache_root())
    except UnsafeCacheError as error:
        warnings.warn(f"pagedgen: native kernel cache not used: {error}; building in a private "
                      "temporary folder (make the cache folder yours, mode 700)")
        return temporary_private_folder()
