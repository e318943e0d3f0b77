"""The engine's side of the prefix store: copy stored blocks into the pool before a step, hand
blocks that became full to the background writer after it, and count what the store saved.

The engine never waits on the disk for a write: after the step the new full blocks are copied
out of the pool in one tensor copy and queued; the writer thread does the rest, or drops them.
Reads happen at admission (a stored block replaces computing it, so it is on the step's path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .prefix_store import BlockStore, BlockWriter, StoreIdentity
from .store_link import StoreLink


@dataclass(frozen=True, slots=True)
class PrefixStoreSetup:
    """What the engine needs to use a store: the folder's store and this run's identity."""

    store: BlockStore
    identity: StoreIdentity


@dataclass(slots=True)
class PrefixStoreReport:
    """Cumulative since the engine was built (the memory report's "prefix store" section)."""

    folder: str
    hit_blocks: int
    hit_tokens: int
    bytes_read: int
    read_seconds: float
    damaged_removed: int
    blocks_written: int
    bytes_written: int
    writes_dropped: int
    write_stopped: str | None
    prefill_seconds_saved: float   # hit tokens x this run's measured forward seconds per token


class StoreTraffic:
    def __init__(self, setup: PrefixStoreSetup, link: StoreLink, block_size: int) -> None:
        self.store = setup.store
        self.link = link
        self.block_size = block_size
        self.writer = BlockWriter(setup.store)
        self._forward_seconds = 0.0
        self._forward_tokens = 0

    def before_step(self, runner: Any) -> None:
        loads = self.link.take_loads()
        if loads:
            runner.write_blocks([pages for pages, _ in loads], [p for _, p in loads])

    def after_step(self, runner: Any, forward_seconds: float, tokens: int) -> None:
        self._forward_seconds += forward_seconds
        self._forward_tokens += tokens
        saves = self.link.take_saves()
        if not saves or self.writer.stopped_reason is not None:
            self.writer.counters.dropped_stopped += len(saves)  # no copy for a stopped writer
            return
        rows = runner.read_blocks([pages for pages, _ in saves])
        for (_, key), row in zip(saves, rows):
            if not self.writer.submit(key, row):
                self.link.forget_queued(key)

    def drop_pending(self) -> None:
        self.link.take_loads()
        self.link.take_saves()

    def flush(self, timeout: float | None = 60.0) -> bool:
        return self.writer.flush(timeout)

    def report(self) -> PrefixStoreReport:
        reads, writes = self.store.counters, self.writer.counters
        hit_tokens = self.link.counters.hit_blocks * self.block_size
        per_token = self._forward_seconds / self._forward_tokens if self._forward_tokens else 0.0
        return PrefixStoreReport(
            str(self.store.folder), self.link.counters.hit_blocks, hit_tokens, reads.bytes_read,
            reads.read_seconds, reads.bad_removed, writes.written, writes.bytes_written,
            writes.dropped_queue_full + writes.dropped_stopped, self.writer.stopped_reason,
            max(0.0, hit_tokens * per_token - reads.read_seconds))


def attach_store(kv: Any, runner: Any, setup: PrefixStoreSetup) -> StoreTraffic:
    link = StoreLink(setup.store, setup.identity.root, runner.num_blocks, runner.block_size,
                     runner.block_payload_size,
                     read_own_blocks=getattr(runner, "kv_scales", None) is None)
    kv.attach_store(link)
    return StoreTraffic(setup, link, runner.block_size)
