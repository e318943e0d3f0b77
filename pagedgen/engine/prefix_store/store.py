"""BlockStore: one file per block in a private folder, bounded in size, shared by processes.

Layout (docs/prefix_store.md): DIR/blocks-v1/<first two hex digits>/<64 hex digits>.kvb, one
file per block named by its key. One file per block because a block is the unit that is
looked up, written, checked and evicted: a write is one atomic rename (no index to keep in step
across processes, no lock), a damaged file costs one block, and eviction is an unlink. The 256
subfolders keep folders small (a million blocks: ~4,000 files each).

Least recently used: a read sets the file's mtime to now (atime is unreliable under noatime /
relatime mounts), and eviction deletes the oldest mtimes first.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from pagedgen.kernels.cpu.native_cache import privacy_problem
from pagedgen.settings.table import default

from . import block_file
from .atomic import write_atomically

DEFAULT_MAX_BYTES = default("prefix_store_max_size")
DEFAULT_MIN_FREE_BYTES = default("prefix_store_min_free")
BLOCKS_FOLDER = "blocks-v1"
SUFFIX = ".kvb"


class StoreWarning(RuntimeWarning):
    """The store could not do something; the run goes on without it."""


class UnsafeStoreError(OSError):
    """The store folder could be written by someone else: its blocks cannot be trusted."""


@dataclass(slots=True)
class StoreStats:
    files: int = 0
    bytes: int = 0               # bytes allocated on disk (st_blocks), not just file sizes
    logical_bytes: int = 0       # sum of file sizes
    oldest_mtime: float | None = None
    newest_mtime: float | None = None


@dataclass(slots=True)
class VerifyResult:
    good: int = 0
    bad: list[str] = field(default_factory=list)  # "path: reason"
    removed: int = 0
    temporary_removed: int = 0


@dataclass(slots=True)
class ReadCounters:
    hits: int = 0
    misses: int = 0
    bad_removed: int = 0         # damaged or foreign files found (and removed) on read
    bytes_read: int = 0
    read_seconds: float = 0.0


class BlockStore:
    def __init__(self, folder: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES,
                 min_free_bytes: int = DEFAULT_MIN_FREE_BYTES, create: bool = True) -> None:
        self.folder = Path(folder).expanduser()
        self.max_bytes = int(max_bytes)
        self.min_free_bytes = int(min_free_bytes)
        if self.max_bytes <= 0:
            raise ValueError(f"prefix store max_bytes must be > 0, got {max_bytes}")
        self.blocks = self.folder / BLOCKS_FOLDER
        self.digests = self.folder / "model-digests"
        for path in (self.folder, self.blocks, self.digests):
            if create and not path.exists():
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
            require_private(path)
        self.counters = ReadCounters()
        self._warned: set[str] = set()

    # --- one block ---
    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.blocks / name[:2] / (name + SUFFIX)

    def contains(self, key: bytes) -> bool:
        return os.path.exists(self.path_of(key))

    def read(self, key: bytes, payload_size: int | None = None) -> memoryview | None:
        """The block's payload, or None: missing, unreadable, or damaged (then removed)."""
        path = self.path_of(key)
        start = time.perf_counter()
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            self.counters.misses += 1
            return None
        except OSError as error:
            self.warn("read", f"prefix store: cannot read {path} ({error}); computing instead")
            self.counters.misses += 1
            return None
        try:
            payload = block_file.decode(data, key, payload_size)
        except block_file.BlockFileError as error:
            self.warn("damaged", f"prefix store: {path} is unusable ({error}); removed it")
            self.discard(path)
            self.counters.misses += 1
            self.counters.bad_removed += 1
            return None
        _touch(path)
        self.counters.hits += 1
        self.counters.bytes_read += len(data)
        self.counters.read_seconds += time.perf_counter() - start
        return payload

    def write(self, key: bytes, payload: bytes | memoryview) -> int:
        """Writes the block unless present (then marks it recently used); the bytes written.
        OSError (a full disk, a read-only folder) is the caller's to handle."""
        path = self.path_of(key)
        if path.exists():
            _touch(path)
            return 0
        path.parent.mkdir(mode=0o700, exist_ok=True)
        return write_atomically(path, block_file.encode(key, payload))

    def discard(self, path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass  # gone already, or a read-only store: it stays a miss either way

    def free_bytes(self) -> int:
        info = os.statvfs(self.blocks)
        return info.f_bavail * info.f_frsize

    # --- the whole store ---
    def block_files(self) -> list[tuple[Path, os.stat_result]]:
        found = []
        for sub in _scandir(self.blocks):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in _scandir(Path(sub.path)):
                try:
                    found.append((Path(entry.path), entry.stat(follow_symlinks=False)))
                except OSError:
                    continue  # evicted by another process meanwhile
        return found

    def stats(self) -> StoreStats:
        result = StoreStats()
        for path, info in self.block_files():
            if path.suffix != SUFFIX:
                continue
            result.files += 1
            result.logical_bytes += info.st_size
            result.bytes += _allocated(info)
            result.oldest_mtime = min(result.oldest_mtime or info.st_mtime, info.st_mtime)
            result.newest_mtime = max(result.newest_mtime or info.st_mtime, info.st_mtime)
        return result

    def evict_to(self, target_bytes: int) -> tuple[int, int]:
        """Deletes least recently used blocks until the store holds <= target_bytes; returns
        (files removed, bytes on disk after)."""
        files = [(info.st_mtime, _allocated(info), path) for path, info in self.block_files()
                 if path.suffix == SUFFIX]
        total = sum(size for _, size, _ in files)
        removed = 0
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= target_bytes:
                break
            self.discard(path)
            total -= size
            removed += 1
        return removed, total

    def verify(self, remove_bad: bool = True, stale_temp_seconds: float = 3600.0) -> VerifyResult:
        """Reads every block whole and checks its header, checksum and name; bad ones are
        removed (unless remove_bad is False), and temporary files older than an hour too
        (left by a killed writer)."""
        result = VerifyResult()
        now = time.time()
        for path, info in self.block_files():
            if path.suffix != SUFFIX:
                if path.name.startswith(".") and now - info.st_mtime > stale_temp_seconds:
                    self.discard(path)
                    result.temporary_removed += 1
                continue
            reason = _verify_file(path)
            if reason is None:
                result.good += 1
                continue
            result.bad.append(f"{path}: {reason}")
            if remove_bad:
                self.discard(path)
                result.removed += 1
        return result

    def clear(self) -> int:
        """Removes every block file (and temporary file); returns how many."""
        count = 0
        for path, _ in self.block_files():
            self.discard(path)
            count += 1
        return count

    def warn(self, kind: str, message: str) -> None:
        """One warning per kind per store object: a damaged store must not flood the log."""
        if kind in self._warned:
            return
        self._warned.add(kind)
        warnings.warn(message, StoreWarning, stacklevel=3)


def require_private(path: Path) -> None:
    """UnsafeStoreError unless path is a folder owned by this user that nobody else can write
    to: a checksum proves a block whole, not that it was computed by this model."""
    try:
        problem = privacy_problem(path)
    except OSError as error:
        raise UnsafeStoreError(f"prefix store folder {path}: {error}") from None
    if problem is not None:
        hint = "; chmod 700 it" if "writable" in problem else ""
        raise UnsafeStoreError(f"prefix store {path} {problem}{hint}")


def _verify_file(path: Path) -> str | None:
    try:
        data = path.read_bytes()
        key = block_file.verify(data)
    except OSError as error:
        return str(error)
    except block_file.BlockFileError as error:
        return str(error)
    if key.hex() + SUFFIX != path.name:
        return "the file holds another key's block"
    return None


def _scandir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError:
        return []


def _allocated(info: os.stat_result) -> int:
    blocks = getattr(info, "st_blocks", None)
    return info.st_size if blocks is None else blocks * 512


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only store: LRU order just does not learn from this read
