"""A first-fit contiguous arena: what a non-paged allocator of the same size would suffer.

Each sequence needs one contiguous region (prompt + max_tokens). When sequences of mixed
lengths come and go, the free space splinters into holes; a request can then fail although
the total free space would hold it — external fragmentation, the failure paging removes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass(slots=True)
class ArenaStats:
    allocations: int = 0
    failed_external_fragmentation: int = 0   # enough free slots in total, no hole large enough
    failed_out_of_memory: int = 0            # not enough free slots at all
    peak_used: int = 0
    peak_holes: int = 0


@dataclass(slots=True)
class FirstFitArena:
    size: int
    stats: ArenaStats = field(default_factory=ArenaStats)
    _hole_starts: list[int] = field(default_factory=list)   # sorted
    _hole_lengths: dict[int, int] = field(default_factory=dict)
    _owned: dict[int, tuple[int, int]] = field(default_factory=dict)  # key -> (start, length)
    _used: int = 0

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"arena size must be positive, got {self.size}")
        self._add_hole(0, self.size)

    @property
    def free(self) -> int:
        return self.size - self._used

    def owns(self, key: int) -> bool:
        return key in self._owned

    def allocate(self, key: int, length: int) -> bool:
        """First fit; records why it failed. True when the region was placed."""
        if key in self._owned:
            raise ValueError(f"arena key {key} is already allocated")
        start = next((s for s in self._hole_starts if self._hole_lengths[s] >= length), None)
        if start is None:
            self._count_failure(length)
            return False
        hole = self._remove_hole(start)
        if hole > length:
            self._add_hole(start + length, hole - length)
        self._owned[key] = (start, length)
        self._used += length
        self.stats.allocations += 1
        self.stats.peak_used = max(self.stats.peak_used, self._used)
        return True

    def release(self, key: int) -> None:
        start, length = self._owned.pop(key)
        self._used -= length
        self._insert_merged(start, length)

    def _count_failure(self, length: int) -> None:
        if self.free >= length:
            self.stats.failed_external_fragmentation += 1
        else:
            self.stats.failed_out_of_memory += 1

    def _insert_merged(self, start: int, length: int) -> None:
        # Coalesce with the neighbouring holes so that freed space is reusable as one piece.
        i = bisect.bisect_left(self._hole_starts, start)
        if i < len(self._hole_starts) and self._hole_starts[i] == start + length:
            length += self._remove_hole(start + length)
        if i > 0:
            prev = self._hole_starts[i - 1]
            if prev + self._hole_lengths[prev] == start:
                start, length = prev, length + self._remove_hole(prev)
        self._add_hole(start, length)

    def _add_hole(self, start: int, length: int) -> None:
        bisect.insort(self._hole_starts, start)
        self._hole_lengths[start] = length
        self.stats.peak_holes = max(self.stats.peak_holes, len(self._hole_starts))

    def _remove_hole(self, start: int) -> int:
        self._hole_starts.pop(bisect.bisect_left(self._hole_starts, start))
        return self._hole_lengths.pop(start)
