"""A bounded series of per-step items: keeps every k-th item, doubling k when it overflows.

Long runs have millions of steps; the report must stay small. Doubling the stride keeps the
kept items evenly spaced (the grid of stride 2k is a subset of the grid of stride k), so a
compaction never has to invent or re-sample anything. Items marked `pinned` (the peak) are
kept even off the grid until a newer pinned item replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class _Entry(Generic[T]):
    ordinal: int
    item: T


@dataclass(slots=True)
class SampledSeries(Generic[T]):
    max_items: int
    stride: int = 1
    _entries: list[_Entry[T]] = field(default_factory=list)
    _pinned_ordinal: int = -1
    _count: int = 0

    def __post_init__(self) -> None:
        if self.max_items < 2:
            raise ValueError(f"max_items must be >= 2, got {self.max_items}")

    def wants(self, ordinal: int | None = None) -> bool:
        """Would the next item (or the item with this ordinal) land on the grid?"""
        ordinal = self._count if ordinal is None else ordinal
        return ordinal % self.stride == 0

    def append(self, item: T, pinned: bool = False) -> None:
        """Offer the next item; kept when on the grid or pinned."""
        ordinal = self._count
        self._count += 1
        if pinned:
            self._pinned_ordinal = ordinal
        if pinned or self.wants(ordinal):
            self._entries.append(_Entry(ordinal, item))
            if len(self._entries) > self.max_items:
                self._compact()

    def skip(self) -> None:
        """Count an item that is off the grid without building it (it would be dropped)."""
        self._count += 1

    def _compact(self) -> None:
        while len(self._entries) > self.max_items:
            self.stride *= 2
            self._entries = [
                e for e in self._entries
                if e.ordinal % self.stride == 0 or e.ordinal == self._pinned_ordinal
            ]

    def items(self) -> list[T]:
        return [e.item for e in self._entries]

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def offered(self) -> int:
        """How many items were offered in total (kept or not)."""
        return self._count
