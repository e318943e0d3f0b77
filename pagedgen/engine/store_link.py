"""The KV manager's side of the prefix store: block keys, store hits at admission, and the
list of blocks to write behind.

Plain Python like the manager: the store gives payload bytes, the manager pages, and the
engine moves bytes between them and the runner's pool (`take_loads`, `take_saves`). A stored
block is every layer's K/V of its tokens: with several layer groups, its page in each group
(`Pages`). Every block that becomes full is queued once for writing at the step it becomes full
(all groups still hold its page then). The manager keeps each sequence's last key, so a block's
key is its parent's key chained with its tokens, one hash per filled block.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

from .prefix_store import BlockStore, block_keys
from .prefix_store.keys import block_key

_MAX_REMEMBERED = 1 << 20

# A stored block's pages: its page id (a one-group pool), or its page id in each layer group,
# in group order, negative (NULL_BLOCK) where a sliding group does not load that page.
Pages = int | tuple[int, ...]
# need_start(end): the first block index a hit ending at block `end` reads from the store.
NeedStart = abc.Callable[[int], int]


@dataclass(slots=True)
class StoreLinkCounters:
    hit_blocks: int = 0          # blocks served from the store instead of computed
    probe_blocks: int = 0        # blocks read from the store (some may fail their check)
    queued_blocks: int = 0       # blocks handed to the writer


@dataclass(slots=True)
class StoreRead:
    """What one admission read: the hit ends at block `end`; blocks start .. end-1 read back
    whole (payloads[i - start]); blocks first .. start-1 are not needed (no group reads them)."""

    first: int
    start: int
    end: int
    parent: bytes                # key of block end-1 (the root for 0): the chain goes on from it
    keys: list[bytes]            # keys of blocks start .. end-1
    payloads: list[memoryview]   # their payloads


class StoreLink:
    __slots__ = ("store", "root", "block_size", "payload_size", "counters", "_loads",
                 "_saves", "_queued", "_own", "_probe_memo")

    def __init__(self, store: BlockStore, root: bytes, num_blocks: int, block_size: int,
                 payload_size: int | None = None, read_own_blocks: bool = True) -> None:
        """num_blocks: the pool's pages (keys live with the sequences, so nothing is sized by
        it; kept so that every caller builds a link alike).

        read_own_blocks False: blocks this run computed are never read back from the store
        (they are computed again once they leave memory). For an 8-bit pool: a block's codes
        depend on how it was filled (its scale grows with the tokens written into it, and the
        codes already there are quantized again), so a stored block and the same block
        computed again can differ, and whether the writer has reached a block yet is timing:
        reading back the run's own blocks would make its outputs depend on the disk's speed.
        """
        self.store = store
        self.root = root
        self.block_size = block_size
        self.payload_size = payload_size
        self.counters = StoreLinkCounters()
        self._loads: list[tuple[Pages, memoryview]] = []
        self._saves: list[tuple[Pages, bytes]] = []
        self._queued: set[bytes] = set()
        self._own: set[bytes] | None = None if read_own_blocks else set()
        self._probe_memo: tuple[tuple[int, int, int, int], int] | None = None

    def probe(self, token_ids: abc.Sequence[int], first: int, last: int,
              need_start: NeedStart | None = None) -> int:
        """The end (in blocks, at most `last`) of the longest store hit after the first `first`
        blocks, by the files present (their content is checked when read). need_start None:
        the hit needs every block from `first` (a full-attention group), so it ends at the first
        missing file. Remembered for the same prompt, so that the scheduler's question and the
        admission that follows agree and a waiting prompt costs no new stats."""
        memo_key = (id(token_ids), len(token_ids), first, last)
        if self._probe_memo is not None and self._probe_memo[0] == memo_key:
            return self._probe_memo[1]
        end = first
        if first < last:
            keys = list(block_keys(self.root, token_ids, self.block_size, last))

            def present(index: int) -> bool:
                return self._usable(keys[index]) and self.store.contains(keys[index])

            if need_start is None:
                end = _present_run_end(first, last, present)
            else:
                end = hit_end(first, last, need_start, present)
        self._probe_memo = (memo_key, end)
        return end

    def read(self, token_ids: abc.Sequence[int], first: int, end: int,
             need_start: NeedStart | None = None) -> StoreRead:
        """Reads what a hit ending at `end` needs, newest block first (so the head of a chain
        is the most recently used file, evicted last); a block that fails its check moves the
        end before it, to the largest end whose blocks all read back whole."""
        self._probe_memo = None
        keys = list(block_keys(self.root, token_ids, self.block_size, end))
        need = need_start or (lambda _end: first)
        payloads: dict[int, memoryview] = {}

        def readable(index: int) -> bool:
            if not self._usable(keys[index]):
                return False
            self.counters.probe_blocks += 1
            payload = self.store.read(keys[index], self.payload_size)
            if payload is not None:
                payloads[index] = payload
            return payload is not None

        found = hit_end(first, end, need, readable)
        start = need(found) if found > first else found
        parent = keys[found - 1] if found else self.root
        return StoreRead(first, start, found, parent, keys[start:found],
                         [payloads[i] for i in range(start, found)])

    def _usable(self, key: bytes) -> bool:
        return self._own is None or key not in self._own

    def chain_key(self, token_ids: abc.Sequence[int], count: int) -> bytes:
        """The key of block count-1 (the root for 0): where a sequence's chain goes on."""
        keys = list(block_keys(self.root, token_ids, self.block_size, count))
        return keys[-1] if keys else self.root

    def loaded(self, pages: Pages, key: bytes, payload: memoryview) -> None:
        """A block read from the store goes into these pages before the next step."""
        self._loads.append((pages, payload))
        self._queued.add(key)  # on disk already

    def served(self, blocks: int) -> None:
        """Blocks an admission did not compute thanks to the store (read or, before every
        window, not needed at all)."""
        self.counters.hit_blocks += blocks

    def filled(self, pages: abc.Sequence[Pages], parent: bytes,
               token_blocks: abc.Sequence[abc.Sequence[int]]) -> bytes:
        """Blocks in `pages` just became full with these tokens, chained after `parent`;
        returns the last one's key."""
        if len(self._queued) > _MAX_REMEMBERED:
            self._queued.clear()  # only a shortcut: the writer skips blocks already on disk
        for block_pages, tokens in zip(pages, token_blocks):
            key = block_key(parent, tokens)
            if key not in self._queued:
                self._queued.add(key)
                self._saves.append((block_pages, key))
                if self._own is not None:
                    self._own.add(key)
            parent = key
        return parent

    def forget_queued(self, key: bytes) -> None:
        """A queued block that was not written (dropped): it may be queued again later."""
        self._queued.discard(key)

    def take_loads(self) -> list[tuple[Pages, memoryview]]:
        loads, self._loads = self._loads, []
        return loads

    def take_saves(self) -> list[tuple[Pages, bytes]]:
        saves, self._saves = self._saves, []
        self.counters.queued_blocks += len(saves)
        return saves


def _present_run_end(first: int, last: int, present: abc.Callable[[int], bool]) -> int:
    end = first
    while end < last and present(end):
        end += 1
    return end


def hit_end(first: int, last: int, need_start: NeedStart,
            have: abc.Callable[[int], bool]) -> int:
    """The largest end in [first, last] whose needed blocks, need_start(end) .. end-1, all
    `have`; `first` when none. Searched from `last` down, asking each index at most once: a
    block that fails rules out every end that needs it, which is every end after it (window
    starts only move forward), so the search goes on from the end just before it."""
    end, index = last, last - 1
    while end > first:
        start = need_start(end)
        while index >= start and have(index):
            index -= 1
        if index < start:
            return end
        end, index = index, index - 1
    return first
