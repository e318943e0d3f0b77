"""Plain data and errors of the paged KV memory manager (no logic, no torch).

`PoolSnapshot` is what the scheduler and the memory tracker read every step; `KVCounters` are
cumulative since the manager was built. The errors all derive from `KVCacheError` so a caller can
catch the family, and each also derives from the builtin a Python programmer would expect
(`RuntimeError` for "out of memory", `LookupError` for unknown ids, `ValueError` for misuse).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class GroupSnapshot:
    """One layer group of a hybrid pool (pages belong to one group at a time)."""

    window: int  # its sliding window in tokens; 0 = full attention
    blocks_used: int  # pages with ref count > 0 in this group's tables
    window_released: int  # cumulative references its window gave back (0 for a full group)
    released_entries: int  # table entries its window has released, now (what full attention
    #                        would still hold, a shared block once per table)


@dataclass(slots=True)
class PoolSnapshot:
    """The pool at one moment. Every field is kept incrementally, so taking one is O(1).

    Not frozen: a frozen dataclass pays an object.__setattr__ per field, and one is built every
    engine step. Each call returns a new object, so holding on to one is safe.
    """

    num_blocks: int
    blocks_used: int  # ref count > 0
    blocks_free: int  # ref count == 0, cached ones included (they are evicted on demand)
    blocks_cached_free: int  # ref count == 0 and still carrying a prefix hash
    blocks_shared: int  # ref count > 1
    logical_blocks: int  # sum of all block-table lengths (what unshared storage would need)
    tokens_stored: int  # filled slots of used blocks; a shared block counts once
    groups: tuple[GroupSnapshot, ...] = ()  # per layer group; empty for a single-group pool


@dataclass(slots=True)
class KVCounters:
    """Cumulative event counts since the manager was built."""

    blocks_allocated: int = 0  # fresh blocks handed out (new tokens or copy-on-write targets)
    blocks_freed: int = 0  # blocks whose last reference went (cached or not)
    cow_copies: int = 0  # copy-on-write copies recorded for the runner
    prefix_query_tokens: int = 0  # prompt tokens looked up at admit (prefix caching on)
    prefix_hit_tokens: int = 0  # of those, tokens served from cached blocks
    evictions: int = 0  # cached free blocks whose hash was dropped to reuse the block
    window_released: int = 0  # block references sliding windows gave back


class KVCacheError(Exception):
    """Base of every error raised by the KV memory manager."""


class NoFreeBlocksError(KVCacheError, RuntimeError):
    """The pool cannot serve a request for blocks; nothing was changed."""

    def __init__(self, message: str, needed: int, available: int, total: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.total = total


class UnknownSequenceError(KVCacheError, LookupError):
    """A sequence id that is not (or no longer) registered."""


class DuplicateSequenceError(KVCacheError, ValueError):
    """A sequence id that is already registered."""


class BlockStateError(KVCacheError, ValueError):
    """An operation that does not fit a block's state (double free, invalid id, rehash)."""
