"""Physical KV blocks: ref counts, an O(1) free queue, and the prefix-hash registry.

Every block is in exactly one of three states:

* **used**: ref count > 0, listed in at least one block table;
* **queued free**: ref count 0, linked into the free queue (it was used once);
* **fresh**: ref count 0, never handed out yet (id >= `_fresh`).

Fresh blocks are kept as a frontier instead of being linked up front, so building a pool of a
million blocks allocates a few flat lists and no per-block objects.

The free queue is a doubly linked list over two flat int lists (`_prev`, `_next`) with a sentinel
node, so pushing, popping and unlinking a block from the middle (a prefix hit on a cached free
block) are all O(1). Its order is the allocation order:

* plain (unhashed) freed blocks are pushed at the front: they hold nothing reusable, so they are
  handed out first, most recently freed first;
* blocks that still carry a prefix hash are pushed at the back: they are handed out only when
  no plain and no fresh block is left, least recently freed first (LRU). Taking one out drops its
  hash (an eviction). The manager frees a table tail first, so a chain's tail is evicted before
  its head.

Thus, all plain blocks precede all hashed ones in the queue; `check_integrity` verifies it.
A hash is written once, when a used block becomes full, and removed only on eviction.
"""

from __future__ import annotations

from .block_hash import BlockHash
from .kv_types import BlockStateError, KVCounters, NoFreeBlocksError


class BlockPool:
    __slots__ = (
        "num_blocks", "counters", "_ref", "_hash_value", "_hash_key", "_prev", "_next", "_sentinel", "_fresh",
        "_num_queued", "_num_cached_free", "_num_shared", "_cache",
    )

    def __init__(self, num_blocks: int, counters: KVCounters | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.counters = counters if counters is not None else KVCounters()
        self._ref = [0] * num_blocks
        # A block's prefix hash, split into two flat lists of GC-untracked values (see BlockHash).
        self._hash_value: list[int | None] = [None] * num_blocks
        self._hash_key: list[tuple | None] = [None] * num_blocks
        # Node `num_blocks` is the sentinel: _next[sentinel] is the head, _prev[sentinel] the tail.
        self._sentinel = num_blocks
        self._prev = [num_blocks] * (num_blocks + 1)
        self._next = [num_blocks] * (num_blocks + 1)
        self._fresh = 0
        self._num_queued = 0
        self._num_cached_free = 0
        self._num_shared = 0
        self._cache: dict[int, int] = {}  # hash value -> block carrying that hash

    @classmethod
    def holding(cls, refs: list[int], counters: KVCounters | None = None) -> BlockPool:
        """A pool where block b has refs[b] references and no block carries a hash; the
        unreferenced ones are queued free (plain). For recounting after a cut update."""
        pool = cls(len(refs), counters)
        pool._ref = list(refs)
        pool._fresh = pool.num_blocks
        for block, ref in enumerate(refs):
            if ref == 0:
                pool._link_after(pool._prev[pool._sentinel], block)
        pool._num_shared = sum(1 for ref in refs if ref > 1)
        return pool

    # --- counts (all O(1)) ---
    @property
    def num_free(self) -> int:
        return self._num_queued + self.num_blocks - self._fresh

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        return self._num_cached_free

    @property
    def num_shared(self) -> int:
        return self._num_shared

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def is_shared(self, block: int) -> bool:
        """More than one reference. Unchecked, unlike ref_count: for ids read from the manager's
        own block tables, asked for every running sequence every step."""
        return self._ref[block] > 1

    def block_hash(self, block: int) -> BlockHash | None:
        self._check_id(block)
        value = self._hash_value[block]
        return None if value is None else BlockHash(value, self._hash_key[block])

    # --- allocation and references ---
    def allocate(self) -> int:
        """Hand out a free block with ref count 1 and no hash (evicting a cached one if needed)."""
        block = self._take_free_block()
        self._ref[block] = 1
        self.counters.blocks_allocated += 1
        return block

    def incref(self, block: int) -> None:
        """Add a reference; a cached free block is taken back out of the free queue."""
        self._check_id(block)
        ref = self._ref[block]
        if ref == 0:
            if self._hash_value[block] is None:
                raise BlockStateError(f"block {block} is free and not cached; allocate instead")
            self._unlink(block)
        elif ref == 1:
            self._num_shared += 1
        self._ref[block] = ref + 1

    def decref(self, block: int) -> bool:
        """Drop a reference; returns True when it was the last one (the block is now free)."""
        self._check_id(block)
        ref = self._ref[block]
        if ref == 0:
            raise BlockStateError(f"block {block} freed twice: its ref count is already 0")
        self._ref[block] = ref - 1
        if ref == 2:
            self._num_shared -= 1
        elif ref == 1:
            self._release(block)
            self.counters.blocks_freed += 1
            return True
        return False

    # --- prefix-hash registry ---
    def register_hash(self, block: int, block_hash: BlockHash) -> bool:
        """Give a used, full block its hash. Returns False (block stays plain) if another block
        already carries this hash: the same tokens are not cached twice."""
        self._check_id(block)
        if self._ref[block] == 0:
            raise BlockStateError(f"block {block} is free; only a used block can get a hash")
        if self._hash_value[block] is not None:
            raise BlockStateError(f"block {block} already has a hash (hashes are write-once)")
        if block_hash.value in self._cache:
            return False
        self._hash_value[block] = block_hash.value
        self._hash_key[block] = block_hash.key
        self._cache[block_hash.value] = block
        return True

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block carrying this hash, if its recorded tokens and extra key match too."""
        block = self._cache.get(block_hash.value)
        if block is None or self._hash_key[block] != block_hash.key:
            return None
        return block

    # --- the free queue ---
    def _take_free_block(self) -> int:
        head = self._next[self._sentinel]
        if head != self._sentinel and self._hash_value[head] is None:
            self._unlink(head)
            return head
        if self._fresh < self.num_blocks:
            self._fresh += 1
            return self._fresh - 1
        if head == self._sentinel:
            raise NoFreeBlocksError(
                f"no free KV block: all {self.num_blocks} blocks are in use",
                needed=1, available=0, total=self.num_blocks)
        self._unlink(head)
        self._evict(head)
        return head

    def _release(self, block: int) -> None:
        if self._hash_value[block] is None:
            self._link_after(self._sentinel, block)  # front: reused first
        else:
            self._link_after(self._prev[self._sentinel], block)  # back: most recently used

    def _evict(self, block: int) -> None:
        del self._cache[self._hash_value[block]]
        self._hash_value[block] = self._hash_key[block] = None
        self.counters.evictions += 1

    def _link_after(self, node: int, block: int) -> None:
        following = self._next[node]
        self._prev[block], self._next[block] = node, following
        self._next[node] = self._prev[following] = block
        self._num_queued += 1
        if self._hash_value[block] is not None:
            self._num_cached_free += 1

    def _unlink(self, block: int) -> None:
        before, after = self._prev[block], self._next[block]
        self._next[before], self._prev[after] = after, before
        self._num_queued -= 1
        if self._hash_value[block] is not None:
            self._num_cached_free -= 1

    def _check_id(self, block: int) -> None:
        if not (isinstance(block, int) and 0 <= block < self.num_blocks):
            raise BlockStateError(f"block id must be an int in [0, {self.num_blocks}), got {block!r}")

    def cached_free_blocks(self) -> list[int]:
        """The cached free blocks, least recently freed (next evicted) first.

        O(cached): they are exactly the last `num_cached_free` nodes of the queue (plain blocks
        always sit in front of hashed ones), so the walk starts at the tail and stops there."""
        blocks, node = [], self._prev[self._sentinel]
        for _ in range(self._num_cached_free):
            blocks.append(node)
            node = self._prev[node]
        blocks.reverse()
        return blocks

    # --- verification (O(num_blocks); tests and debugging only) ---
    def free_queue(self) -> list[int]:
        """The queued free blocks in allocation order (fresh blocks not included)."""
        order, node = [], self._next[self._sentinel]
        while node != self._sentinel:
            order.append(node)
            node = self._next[node]
        return order

    def check_integrity(self) -> None:
        """Recount everything; raises AssertionError naming the first inconsistency."""
        queue = self._checked_queue()
        queued = set(queue)
        for block in range(self.num_blocks):
            self._check_block_state(block, block in queued)
        hashed = [self._hash_value[b] is not None for b in queue]
        assert hashed == sorted(hashed), "a plain block sits behind a cached one in the free queue"
        assert self._num_cached_free == sum(hashed), "cached-free count differs from a recount"
        shared = sum(1 for ref in self._ref if ref > 1)
        assert self._num_shared == shared, f"shared count {self._num_shared} != recount {shared}"
        for value, block in self._cache.items():
            assert self._hash_value[block] == value, f"hash {value} -> block {block}, " \
                "which does not carry it"
            assert hash(self._hash_key[block]) == value, f"block {block}: key does not hash to value"
        carrying = sum(1 for h in self._hash_value if h is not None)
        assert carrying == len(self._cache), "a block carries a hash missing from the registry"

    def _checked_queue(self) -> list[int]:
        queue, node, seen = [], self._sentinel, set()
        while True:
            following = self._next[node]
            assert self._prev[following] == node, f"free queue links broken at block {node}"
            if following == self._sentinel:
                break
            assert following not in seen, f"free queue has a cycle at block {following}"
            seen.add(following)
            queue.append(following)
            node = following
        assert len(queue) == self._num_queued, f"queue length {len(queue)} != {self._num_queued}"
        return queue

    def _check_block_state(self, block: int, queued: bool) -> None:
        ref = self._ref[block]
        assert ref >= 0, f"block {block} has a negative ref count"
        if block >= self._fresh:
            assert ref == 0 and not queued and self._hash_value[block] is None, \
                f"fresh block {block} is not pristine"
        elif ref == 0:
            assert queued, f"block {block} has ref 0 but is not in the free queue"
        else:
            assert not queued, f"block {block} has ref {ref} but sits in the free queue"
