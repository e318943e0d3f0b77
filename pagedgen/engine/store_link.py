"""The KV manager's side of the prefix store: block keys, store hits at admission, and the
list of blocks to write behind.

Plain Python like the manager: the store gives payload bytes, the manager blocks, and the
engine moves bytes between them and the runner's pool (`take_loads`, `take_saves`). Every block
that becomes full is queued once for writing, for every layer, at the step it becomes full;
keys are kept per physical block so a block's key is its parent's key chained with its tokens.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

from .prefix_store import BlockStore, block_keys
from .prefix_store.keys import block_key

_MAX_REMEMBERED = 1 << 20


@dataclass(slots=True)
class StoreLinkCounters:
    hit_blocks: int = 0          # blocks served from the store instead of computed
    probe_blocks: int = 0        # blocks the store announced (some may fail their check)
    queued_blocks: int = 0       # blocks handed to the writer


class StoreLink:
    __slots__ = ("store", "root", "block_size", "payload_size", "counters", "_keys", "_loads",
                 "_saves", "_queued", "_probe_memo")

    def __init__(self, store: BlockStore, root: bytes, num_blocks: int, block_size: int,
                 payload_size: int | None = None) -> None:
        self.store = store
        self.root = root
        self.block_size = block_size
        self.payload_size = payload_size
        self.counters = StoreLinkCounters()
        self._keys: list[bytes | None] = [None] * num_blocks
        self._loads: list[tuple[int, memoryview]] = []
        self._saves: list[tuple[int, bytes]] = []
        self._queued: set[bytes] = set()
        self._probe_memo: tuple[tuple[int, int, int, int], int] | None = None

    def probe(self, token_ids: abc.Sequence[int], first: int, max_blocks: int) -> int:
        """How many blocks after the first `first` are in the store (file present; their
        content is checked when read). Remembered for the same prompt, so that the scheduler's
        question and the admission that follows agree and a waiting prompt costs no new stats."""
        memo_key = (id(token_ids), len(token_ids), first, max_blocks)
        if self._probe_memo is not None and self._probe_memo[0] == memo_key:
            return self._probe_memo[1]
        count = 0
        if first < max_blocks:
            keys = block_keys(self.root, token_ids, self.block_size, max_blocks)
            for index, key in enumerate(keys):
                if index < first:
                    continue
                if not self.store.contains(key):
                    break
                count += 1
        self._probe_memo = (memo_key, count)
        return count

    def read(self, token_ids: abc.Sequence[int], first: int, count: int) -> list[tuple[bytes, memoryview]]:
        """(key, payload) of blocks first .. first+count-1, stopping at the first that fails."""
        self._probe_memo = None
        self.counters.probe_blocks += count
        found = []
        keys = block_keys(self.root, token_ids, self.block_size, first + count)
        for index, key in enumerate(keys):
            if index < first:
                continue
            payload = self.store.read(key, self.payload_size)
            if payload is None:
                break
            found.append((key, payload))
        return found

    def loaded(self, block: int, key: bytes, payload: memoryview) -> None:
        self._keys[block] = key
        self._loads.append((block, payload))
        self._queued.add(key)  # on disk already
        self.counters.hit_blocks += 1

    def filled(self, table: list[int], first: int, token_blocks: abc.Sequence[abc.Sequence[int]]) -> None:
        """Blocks table[first:first+len(token_blocks)] just became full with these tokens."""
        parent = self.root if first == 0 else self._keys[table[first - 1]]
        if parent is None:
            return  # never happens by construction; unkeyed blocks just are not stored
        if len(self._queued) > _MAX_REMEMBERED:
            self._queued.clear()  # only a shortcut: the writer skips blocks already on disk
        for offset, tokens in enumerate(token_blocks):
            block = table[first + offset]
            key = block_key(parent, tokens)
            self._keys[block] = key
            if key not in self._queued:
                self._queued.add(key)
                self._saves.append((block, key))
            parent = key

    def forget_queued(self, key: bytes) -> None:
        """A queued block that was not written (dropped): it may be queued again later."""
        self._queued.discard(key)

    def take_loads(self) -> list[tuple[int, memoryview]]:
        loads, self._loads = self._loads, []
        return loads

    def take_saves(self) -> list[tuple[int, bytes]]:
        saves, self._saves = self._saves, []
        self.counters.queued_blocks += len(saves)
        return saves
