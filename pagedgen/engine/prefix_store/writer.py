"""BlockWriter: writes blocks behind the engine, on its own thread, through a bounded queue.

The engine hands over (key, payload) and never waits: when the queue is full the block is
dropped (counted) rather than stall a step. The thread keeps the store under its size limit
(least recently used first) and stops writing, with one warning, when the disk is full, the
folder is read-only, or free space falls below the floor; the run goes on either way.
"""

from __future__ import annotations

import errno
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .store import BlockStore

_STOP = object()
_FATAL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
_FREE_SPACE_RECHECK_BYTES = 64 * 2**20
_ALLOCATION_UNIT = 4096   # the usual filesystem block: a file takes whole ones


@dataclass(slots=True)
class WriterCounters:
    submitted: int = 0
    written: int = 0
    bytes_written: int = 0       # file bytes (header included)
    already_there: int = 0
    dropped_queue_full: int = 0
    dropped_stopped: int = 0     # after the writer stopped (disk full, read-only, floor)
    failed: int = 0
    evicted: int = 0


class BlockWriter:
    def __init__(self, store: BlockStore, max_queue: int = 256,
                 on_written: Callable[[bytes], None] | None = None) -> None:
        self.store = store
        self.counters = WriterCounters()
        self.stopped_reason: str | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._on_written = on_written
        self._used: int | None = None          # bytes on disk, scanned on the first write
        self._free_known = 0                   # free bytes at the last check, minus writes since
        self._thread = threading.Thread(target=self._loop, name="pagedgen-kv-store-writer",
                                        daemon=True)
        self._thread.start()

    def submit(self, key: bytes, payload: object) -> bool:
        """Queues one block (payload: bytes, or anything memoryview() reads, e.g. a numpy
        array); False when dropped. Never blocks."""
        self.counters.submitted += 1
        if self.stopped_reason is not None:
            self.counters.dropped_stopped += 1
            return False
        try:
            self._queue.put_nowait((key, payload))
        except queue.Full:
            self.counters.dropped_queue_full += 1
            return False
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued block is written (end of a run, tests); True when done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        self.flush(timeout)
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    # --- the thread ---
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._write_one(*item)
            except Exception as error:  # noqa: BLE001 - the writer must outlive any one block
                self.counters.failed += 1
                self.store.warn("writer", f"prefix store: writing a block failed ({error!r})")
            finally:
                self._queue.task_done()

    def _write_one(self, key: bytes, payload: object) -> None:
        if self.stopped_reason is not None:
            self.counters.dropped_stopped += 1
            return
        data = memoryview(payload).cast("B")
        if not self._room_for(len(data)):
            return
        try:
            written = self.store.write(key, data)
        except OSError as error:
            self._failed(error)
            return
        if written == 0:
            self.counters.already_there += 1
            return
        self.counters.written += 1
        self.counters.bytes_written += written
        self._free_known -= written
        if self._on_written is not None:
            self._on_written(key)
        self._keep_under_limit(written)

    def _room_for(self, size: int) -> bool:
        """Free space stays above the floor (rechecked every 64 MiB written)."""
        if self._free_known - size < self.store.min_free_bytes + _FREE_SPACE_RECHECK_BYTES:
            try:
                self._free_known = self.store.free_bytes()
            except OSError as error:
                self._stop(f"cannot read the free space ({error})")
                return False
        if self._free_known - size < self.store.min_free_bytes:
            self._stop(f"free space below the floor of {self.store.min_free_bytes >> 20} MiB")
            return False
        return True

    def _keep_under_limit(self, written: int) -> None:
        if self._used is None:
            self._used = self.store.stats().bytes
        else:
            # Counted as the disk allocates it (the limit is on disk use; evict_to recounts).
            self._used += -(-written // _ALLOCATION_UNIT) * _ALLOCATION_UNIT
        if self._used > self.store.max_bytes:
            removed, self._used = self.store.evict_to(int(self.store.max_bytes * 0.9))
            self.counters.evicted += removed

    def _failed(self, error: OSError) -> None:
        if error.errno in _FATAL:
            self._stop(f"{error.strerror or error}")
        else:
            self.counters.failed += 1
            self.store.warn("write", f"prefix store: a block write failed ({error}); going on")

    def _stop(self, reason: str) -> None:
        self.stopped_reason = reason
        self.counters.dropped_stopped += 1
        self.store.warn("stopped", f"prefix store {self.store.folder}: stopped writing: {reason}; "
                                   "the run goes on, computing what it cannot store")
