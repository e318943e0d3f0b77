"""The paged KV memory manager: block tables, demand paging, fork + copy-on-write, prefix cache.

Plain Python (no torch): the scheduler asks it questions and the runner receives block tables
and copy-on-write pairs from it. Contract: docs/contracts.md section 3.

Rules it keeps (B = block_size):

* **Demand paging.** A sequence covering t tokens holds exactly ceil(t / B) blocks; writing token
  index t allocates a block only when t % B == 0. Nothing is reserved ahead.
* **Zero-copy fork, copy-on-write.** `fork` copies the parent's table and adds one reference to
  every block. A branch about to write into a shared (ref > 1) partial block gets a fresh block
  and a recorded (src, dst) copy instead; full shared blocks are never copied, and the last
  holder of a shared partial block writes into it in place.
* **Prefix caching** (switchable). A block gets a chained hash (see block_hash.py) in
  `append_slots` as soon as it is full — the engine stores the K/V of the whole flat batch before
  any attention reads it, so a request admitted in the same step may already hit it. `admit`
  reuses the longest run of leading full blocks whose hash matches and whose tokens verify,
  capped so that at least the last prompt token is computed. Released hashed blocks stay
  reusable in the free queue until evicted lazily, LRU first, a chain's tail before its head.
* **No duplicate cached blocks.** When two sequences fill identical blocks at the same time (no
  hit was possible when they were admitted), the first block to become full is registered; the
  later one stays unhashed, is never a prefix hit, and returns to the plain free pool when
  released. So the same tokens do not occupy two cached blocks beyond the life of that sequence.

* **Groups of layers (hybrid models).** Layers are grouped by attention kind (kv_groups.py in
  model/runtime); every group keeps its own block table per sequence, all over one pool of pages
  (a page is one block of every layer of one group, so groups never share a page). A group with a
  sliding window W holds only the blocks covering a sequence's last W tokens: when a sequence
  appends from position s, its blocks wholly before s - W + 1 are released first (no query from
  s on reads them) and their table entries become NULL_BLOCK. Blocks are allocated before a
  long chunk runs and released at the sequence's next append, so a chunk longer than the window
  still sees all its keys. Released hashed blocks keep their hash and join the cached free
  queue like any freed block (lazy eviction, LRU). Every group has its own hash chain over the
  same tokens (the group index is part of the extra key), so chains never depend on which blocks
  are still present. A prefix hit in a sliding group needs only the blocks covering the window
  in front of the hit point; the entries before it are NULL_BLOCK.
* **The prefix store on disk** (attach_store, store_link.py). A stored block is every layer's
  K/V of its tokens: its page in every group, saved when it becomes full (no window has
  released it yet). After the memory hits, an admission takes the stored blocks that follow, up
  to the largest end whose needed blocks all read back whole: a full group needs every one, a
  sliding group only those of its window in front of the end (NULL_BLOCK before, memory hits
  included). A pool whose every group slides therefore serves a hit whose early blocks the
  store has lost.

Errors: bad use raises at once and changes nothing (`append_slots` checks capacity before it
mutates). Copy-on-write pairs must be applied in list order before the step's K/V are written.
"""

from __future__ import annotations

from collections import Counter, abc
from dataclasses import dataclass, field

from pagedgen.model.runtime.kv_groups import pages_for_tokens
from pagedgen.validation import require_int
from pagedgen.settings import default

from .block_hash import BlockHash, as_token_ids, iter_block_hashes
from .block_pool import BlockPool
from .store_link import NeedStart, Pages, StoreLink, StoreRead
from .kv_types import (
    DuplicateSequenceError, GroupSnapshot, KVCounters, NoFreeBlocksError, PoolSnapshot,
    UnknownSequenceError,
)

# Read-only int sequences (lists, tuples). Spelled abc.Sequence, never bare: in the engine
# `Sequence` is the generated sequence (sequence.py).
TokenIds = abc.Sequence[int]
SeqIds = abc.Sequence[int]

# A table entry a sliding window has released. The runner pads it like any unused entry; the
# kernels skip blocks wholly before the window, so it is never read.
NULL_BLOCK = -1


@dataclass(slots=True)
class _SequenceBlocks:
    """What the manager knows about one sequence."""

    tables: list[list[int]]  # one block table per layer group
    num_tokens: int  # tokens covered by each table
    chain_hashes: list[int | None]  # per group: hash value of its last full block
    partial: list[int] = field(default_factory=list)  # tokens of the unfilled last block
    released: list[int] = field(default_factory=list)  # per group: leading NULL_BLOCK entries
    store_key: bytes | None = None  # prefix store key of its last full block (None: no store)

    @property
    def table(self) -> list[int]:
        return self.tables[0]


@dataclass(slots=True)
class _PrefixHit:
    blocks: int  # leading blocks served from the cache (the same in every group)
    tables: list[list[int]]  # per group: its table for them (NULL_BLOCK outside a window)
    chains: list[int | None]  # per group: hash value of the last of them (the next parent)


class KVCacheManager:
    __slots__ = (
        "block_size", "num_blocks", "enable_prefix_caching", "hash_extra_key", "counters",
        "group_windows", "num_groups", "_sliding", "_full",
        "_pool", "_seqs", "_pending_copies", "_logical_blocks", "_tokens_stored", "store",
        "_owner", "_group_used", "_window_released", "_released_entries",
    )

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = default("enable_prefix_caching"),
                 hash_extra_key: object = None, group_windows: abc.Sequence[int] = (0,)) -> None:
        """group_windows: one entry per layer group, its sliding window in tokens (0 = full
        attention). The default, one full group, is the classic single-table manager."""
        require_int("num_blocks", num_blocks)
        require_int("block_size", block_size)
        try:
            hash(hash_extra_key)
        except TypeError:
            raise TypeError(f"hash_extra_key must be hashable, got {hash_extra_key!r}") from None
        windows = tuple(group_windows)
        if not windows:
            raise ValueError("group_windows must name at least one layer group")
        for window in windows:
            require_int("group window", window, 0)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hash_extra_key = hash_extra_key
        self.group_windows = windows
        self.num_groups = len(windows)
        self._sliding = [g for g, w in enumerate(windows) if w]
        self._full = [g for g, w in enumerate(windows) if not w]
        self.counters = KVCounters()
        self._pool = BlockPool(num_blocks, self.counters)
        self._seqs: dict[int, _SequenceBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._logical_blocks = 0
        self._tokens_stored = 0
        self._owner = [0] * num_blocks  # the group a page belongs to while it is used or cached
        self._group_used = [0] * len(windows)
        self._window_released = [0] * len(windows)  # references dropped by each group's window
        self._released_entries = [0] * len(windows)  # NULL_BLOCK entries in live tables
        self.store: StoreLink | None = None  # the prefix store on disk (attach_store)

    # --- side-effect-free questions ---
    def num_cached_prefix_tokens(self, token_ids: TokenIds) -> int:
        hit = self._prefix_hits(token_ids)
        return self._stored_end(token_ids, hit.blocks) * self.block_size

    def blocks_for_tokens(self, num_tokens: int, chunk: int = 1) -> int:
        """Pages one sequence of num_tokens tokens holds at most when it runs alone, computing
        at most `chunk` tokens per step: every block in a full group, the window (plus one
        chunk) in a sliding group."""
        return pages_for_tokens(self.group_windows, num_tokens, self.block_size, chunk)

    def can_admit(self, token_ids: TokenIds, num_new_tokens: int) -> bool:
        """Would `admit(token_ids)` then `append_slots` of `num_new_tokens` tokens (right after
        the cached prefix) succeed now? A hit on a cached free block uses up a free block."""
        require_int("num_new_tokens", num_new_tokens, 0)
        hit = self._prefix_hits(token_ids)
        end = self._stored_end(token_ids, hit.blocks)
        covered = end * self.block_size + num_new_tokens
        if self.blocks_for_tokens(max(len(token_ids), covered), num_new_tokens) > self.num_blocks:
            return False
        return self._admission_pages(hit, end, self._blocks_spanned(covered)) <= self._pool.num_free

    def can_append(self, seq_ids: SeqIds, num_tokens: int | abc.Sequence[int]) -> bool:
        """Can every listed sequence append its tokens, one after another, right now?"""
        return self._blocks_for_group(seq_ids, num_tokens) <= self._pool.num_free

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached free included)."""
        return self._pool.num_free

    def blocks_to_append(self, seq_id: int, num_tokens: int) -> int:
        """Net blocks the append takes from the free pool (negative when the window gives back
        more than the append needs)."""
        require_int("num_tokens", num_tokens, 0)
        seq = self._get(seq_id)
        if num_tokens == 0:
            return 0
        needed = self._new_blocks(seq, num_tokens) * self.num_groups
        for g in range(self.num_groups):
            needed += self._needs_copy(seq, g)
        if self._sliding:
            needed -= self._releasable_free(seq)
        return needed

    def blocks_freed_by(self, seq_ids: SeqIds) -> int:
        """Blocks whose every reference comes from these sequences (freed if they all went)."""
        holds: Counter[int] = Counter()
        for seq_id in set(seq_ids):
            for table in self._get(seq_id).tables:
                holds.update(b for b in table if b != NULL_BLOCK)
        return sum(1 for block, count in holds.items() if count == self._pool.ref_count(block))

    # --- mutations ---
    def admit(self, seq_id: int, token_ids: TokenIds, use_prefix_cache: bool = True) -> int:
        """Register a sequence and take its prefix-cache hits (unless use_prefix_cache is False:
        every token is then computed again); returns the tokens served."""
        self._require_new(seq_id, "seq_id")
        needed = self.blocks_for_tokens(len(token_ids))
        if needed > self.num_blocks:
            raise NoFreeBlocksError(
                f"a prompt of {len(token_ids)} tokens needs {needed} KV blocks of "
                f"{self.block_size} tokens but the pool has only {self.num_blocks} blocks; "
                "give the KV cache more memory or shorten the prompt",
                needed=needed, available=self._pool.num_free, total=self.num_blocks)
        hit = self._prefix_hits(token_ids) if use_prefix_cache else self._no_hit()
        memory_hits = hit.blocks
        read = self._read_store(seq_id, token_ids, hit) if use_prefix_cache else None
        if read is not None:
            # Before any reference is taken: the longer hit's windows may no longer read some.
            self._cut_to_windows(hit.tables, read.end)
        for g, table in enumerate(hit.tables):
            for block in table:
                if block != NULL_BLOCK:
                    self._take_cached(block, g)
        if read is not None:
            self._load_stored(token_ids, hit, read)
        store_key = self._store_key(token_ids, hit.blocks, read)
        released = [table.count(NULL_BLOCK) for table in hit.tables]
        self._seqs[seq_id] = _SequenceBlocks(hit.tables, hit.blocks * self.block_size,
                                             hit.chains, [], released, store_key)
        self._logical_blocks += sum(len(t) - r for t, r in zip(hit.tables, released))
        self._count_released(released, 1)
        if self.enable_prefix_caching:
            self.counters.prefix_query_tokens += len(token_ids)
            self.counters.prefix_hit_tokens += memory_hits * self.block_size
        return hit.blocks * self.block_size

    def append_slots(self, seq_id: int, token_ids: TokenIds) -> None:
        """Reserve slots for the tokens computed this step (see contract); atomic on error."""
        # Called for every running sequence every step: the common decode case (no new block,
        # no copy, no full block) stays free of allocations and extra calls.
        seq = self._get(seq_id)
        count = len(token_ids)
        if count == 0:
            return
        copies = [g for g in range(self.num_groups) if self._needs_copy(seq, g)]
        new_blocks = self._new_blocks(seq, count)
        needed = new_blocks * self.num_groups + len(copies)
        if needed:
            freed = self._releasable_free(seq) if self._sliding else 0
            self._require_free(needed - freed, seq_id)
        # Check and hash the tokens before mutating: the only step left that can raise.
        if self.enable_prefix_caching:
            token_ids = as_token_ids(token_ids)
            completed = [self._completed_block_hashes(seq, token_ids, g)
                         for g in range(self.num_groups)]
        if self._sliding:
            self._release_outside_windows(seq)
        for g in copies:
            self._copy_on_write(seq, g)
        if new_blocks:
            for g, table in enumerate(seq.tables):
                table.extend([self._allocate(g) for _ in range(new_blocks)])
            self._logical_blocks += new_blocks * self.num_groups
        self._tokens_stored += count * self.num_groups
        if self.enable_prefix_caching:
            self._register_hashes(seq, token_ids, completed)
        seq.num_tokens += count

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._get(parent_id)
        self._require_new(child_id, "child_id")
        for table in parent.tables:
            for block in table:
                if block != NULL_BLOCK:
                    self._pool.incref(block)
        self._seqs[child_id] = _SequenceBlocks(
            [list(t) for t in parent.tables], parent.num_tokens, list(parent.chain_hashes),
            list(parent.partial), list(parent.released), parent.store_key)
        self._logical_blocks += sum(len(t) - r for t, r in zip(parent.tables, parent.released))
        self._count_released(parent.released, 1)

    def free(self, seq_id: int) -> None:
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        self._count_released(seq.released, -1)
        for g, table in enumerate(seq.tables):
            self._logical_blocks -= len(table) - seq.released[g]
            # Tail first: freed hashed blocks queue up in this order, so the tail is evicted first.
            for index in range(len(table) - 1, seq.released[g] - 1, -1):
                self._drop(table[index], g, self._block_fill(seq, index))

    def abort(self, keep: abc.Collection[int] = ()) -> None:
        """Drops every sequence but `keep` after an error or Ctrl-C, which may have cut a step
        or one of this manager's own updates short, and recounts the pool from the kept tables.

        Not a free() per sequence: a cut update leaves the counts (and perhaps the free queue)
        half changed, and freeing on top of it fails or leaks. And every prefix hash goes: the
        cut step hashed its blocks before the forward wrote them, so a hashed block may hold
        KV that was never computed, and which ones it hashed cannot be told apart. Kept
        sequences (finished tree nodes) were written whole and stay, with their blocks but
        without hashes. Aborting is rare; a cold in-memory cache is its price (a prefix store
        on disk still serves what completed steps wrote)."""
        kept = {seq_id: self._seqs[seq_id] for seq_id in keep if seq_id in self._seqs}
        refs, fills = [0] * self.num_blocks, {}
        owner = [0] * self.num_blocks
        for seq in kept.values():
            for g, table in enumerate(seq.tables):
                for index in range(seq.released[g], len(table)):
                    block = table[index]
                    refs[block] += 1
                    owner[block] = g
                    fills[block] = self._block_fill(seq, index)
        self._seqs = kept
        self._pool = BlockPool.holding(refs, self.counters)
        self._pending_copies = []
        self._owner = owner
        self._group_used = [sum(1 for b in fills if owner[b] == g) for g in range(self.num_groups)]
        self._released_entries = [sum(seq.released[g] for seq in kept.values())
                                  for g in range(self.num_groups)]
        self._logical_blocks = sum(refs)
        self._tokens_stored = sum(fills.values())

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) pairs recorded since the last call, in the order to apply."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # --- reading ---
    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        return list(self._get(seq_id).tables[group])

    def group_block_tables(self, seq_id: int) -> list[list[int]]:
        """The sequence's table in every group (NULL_BLOCK where a window released a block)."""
        return [list(t) for t in self._get(seq_id).tables]

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).num_tokens

    def slot(self, seq_id: int, token_index: int, group: int = 0) -> int:
        seq = self._get(seq_id)
        if not (isinstance(token_index, int) and 0 <= token_index < seq.num_tokens):
            raise IndexError(
                f"token_index must be in [0, {seq.num_tokens}) for sequence {seq_id}, "
                f"got {token_index!r}")
        block_index, offset = divmod(token_index, self.block_size)
        block = seq.tables[group][block_index]
        if block == NULL_BLOCK:
            raise IndexError(f"token {token_index} of sequence {seq_id} left group {group}'s "
                             "window; its block was released")
        return block * self.block_size + offset

    def snapshot(self) -> PoolSnapshot:
        pool = self._pool
        groups = () if self.num_groups == 1 else tuple(
            GroupSnapshot(*row) for row in zip(self.group_windows, self._group_used,
                                               self._window_released, self._released_entries))
        return PoolSnapshot(
            num_blocks=self.num_blocks, blocks_used=pool.num_used, blocks_free=pool.num_free,
            blocks_cached_free=pool.num_cached_free, blocks_shared=pool.num_shared,
            logical_blocks=self._logical_blocks, tokens_stored=self._tokens_stored,
            groups=groups)

    def block_tables(self) -> dict[int, list[int]]:
        """Per sequence, the pages it holds: its table, or with several groups every group's
        entries that are present, group by group."""
        if self.num_groups == 1:
            return {seq_id: list(seq.table) for seq_id, seq in self._seqs.items()}
        return {seq_id: [b for t in seq.tables for b in t if b != NULL_BLOCK]
                for seq_id, seq in self._seqs.items()}

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref_count(block_id)

    def is_cached(self, block_id: int) -> bool:
        """Whether the block carries a prefix hash (used or cached free)."""
        return self._pool.block_hash(block_id) is not None

    def free_queue(self) -> list[int]:
        """Queued free blocks in the order they would be handed out (O(n); for tests)."""
        return self._pool.free_queue()

    def cached_free_blocks(self) -> list[int]:
        """Free blocks still carrying a prefix hash, next evicted first; O(cached), not O(pool)."""
        return self._pool.cached_free_blocks()

    def check_integrity(self) -> None:
        """Recount everything from the tables, every group; raises AssertionError naming what
        is wrong. With the pool's own check this is free + cached + used == total per group."""
        self._pool.check_integrity()
        fills: dict[int, int] = {}
        holds: Counter[int] = Counter()
        owners: dict[int, int] = {}
        for seq_id, seq in self._seqs.items():
            self._check_sequence(seq_id, seq, fills)
            for g, table in enumerate(seq.tables):
                for block in table[seq.released[g]:]:
                    holds[block] += 1
                    assert owners.setdefault(block, g) == g, \
                        f"block {block} sits in the tables of two groups"
        for block in range(self.num_blocks):
            ref = self._pool.ref_count(block)
            assert ref == holds[block], f"block {block}: ref count {ref} but {holds[block]} " \
                "table entries"
        for block, g in owners.items():
            assert self._owner[block] == g, f"block {block} is used by group {g} but owned by " \
                f"group {self._owner[block]}"
        released = [sum(seq.released[g] for seq in self._seqs.values())
                    for g in range(self.num_groups)]
        assert released == self._released_entries, "released-entry counts differ from the tables"
        used = Counter(owners.values())
        for g in range(self.num_groups):
            assert self._group_used[g] == used[g], \
                f"group {g}: {self._group_used[g]} used blocks counted, {used[g]} in its tables"
        entries = sum(holds.values())
        assert self._logical_blocks == entries, f"logical_blocks {self._logical_blocks} != {entries}"
        assert self._tokens_stored == sum(fills.values()), \
            f"tokens_stored {self._tokens_stored} != recount {sum(fills.values())}"
        assert self._pool.num_used == len(holds), "used block count differs from the tables"

    # --- the prefix store on disk (store_link.py) ---
    def attach_store(self, link: StoreLink) -> None:
        """Any layer grouping: a stored block holds its page of every group (module doc)."""
        if not self.enable_prefix_caching:
            raise ValueError("prefix_store needs prefix caching on (enable_prefix_caching=True)")
        self.store = link

    def _store_need_start(self, first: int) -> NeedStart | None:
        """need_start of the store's hit search after `first` memory-hit blocks: None when a
        full group needs every stored block; else the earliest window start of the hit's end,
        as a pool whose every group slides reads nothing before its windows."""
        if self._full:
            return None
        return lambda end: max(first, min(self._window_start(g, end * self.block_size)
                                          for g in self._sliding))

    def _stored_end(self, token_ids: TokenIds, hit_blocks: int) -> int:
        """Where the hit ends with the store's blocks after the memory hits (by the files
        present; the last prompt token is always computed)."""
        if self.store is None or len(token_ids) < 2:
            return hit_blocks
        last = (len(token_ids) - 1) // self.block_size
        return self.store.probe(token_ids, hit_blocks, last, self._store_need_start(hit_blocks))

    def _read_store(self, seq_id: int, token_ids: TokenIds,
                    hit: _PrefixHit) -> StoreRead | None:
        """The stored blocks after the memory hits that read back whole (None without a store
        or without stored blocks). NoFreeBlocksError, before anything changes, when the pool
        cannot take them: a shorter end (a block that fails) never takes more pages."""
        if self.store is None:
            return None
        end = self._stored_end(token_ids, hit.blocks)
        if end == hit.blocks:
            return None
        self._require_free(self._admission_pages(hit, end, end), seq_id)
        return self.store.read(token_ids, hit.blocks, end, self._store_need_start(hit.blocks))

    def _store_key(self, token_ids: TokenIds, hit_blocks: int,
                   read: StoreRead | None) -> bytes | None:
        """The key of an admitted sequence's last hit block: its chain of store keys goes on
        from there (None without a store)."""
        if self.store is None:
            return None
        return read.parent if read is not None else self.store.chain_key(token_ids, hit_blocks)

    def _cut_to_windows(self, tables: list[list[int]], end: int) -> None:
        """A hit ending at block `end`: NULL_BLOCK where a sliding group's window no longer
        reads a memory-hit block."""
        for g in self._sliding:
            table = tables[g]
            for index in range(min(self._window_start(g, end * self.block_size), len(table))):
                table[index] = NULL_BLOCK

    def _admission_pages(self, hit: _PrefixHit, end: int, spanned: int) -> int:
        """Free pages an admission whose hit ends at block `end` (memory hits, then stored
        blocks) and whose first append reaches `spanned` blocks takes: in each group, its
        cached free memory hits in the window, then a fresh page per block from the memory
        hits' end (or the window's start, if later) on."""
        pages = 0
        for g, table in enumerate(hit.tables):
            start = self._window_start(g, end * self.block_size)
            pages += sum(1 for block in table[start:]
                         if block != NULL_BLOCK and self._pool.ref_count(block) == 0)
            pages += spanned - max(hit.blocks, start)
        return pages

    def _load_stored(self, token_ids: TokenIds, hit: _PrefixHit, read: StoreRead) -> None:
        """Fresh pages, hashed like computed ones, for the blocks read.first .. read.end-1 in
        every group that reads them (NULL_BLOCK before a sliding group's window); the runner
        copies their bytes in before the step."""
        first, count = read.first, read.end - read.first
        if count == 0:
            return  # every block it announced failed its check
        tail = token_ids[first * self.block_size:read.end * self.block_size]
        for g, table in enumerate(hit.tables):
            start = self._window_start(g, read.end * self.block_size)
            hashes = list(iter_block_hashes(tail, self.block_size, count, self._group_key(g),
                                            hit.chains[g]))
            for index, block_hash in enumerate(hashes, first):
                if index < start:
                    table.append(NULL_BLOCK)
                    continue
                block = self._allocate(g)
                self._pool.register_hash(block, block_hash)
                table.append(block)
                self._tokens_stored += self.block_size
            # The chain goes on from the last block's hash, which every group holds.
            hit.chains[g] = hashes[-1].value
        pages = self._pages(hit.tables, read.start, read.end - read.start)
        for block_pages, key, payload in zip(pages, read.keys, read.payloads):
            self.store.loaded(block_pages, key, payload)
        self.store.served(count)
        hit.blocks = read.end

    def _pages(self, tables: list[list[int]], first: int, count: int) -> list[Pages]:
        """Per block first .. first+count-1, its pages as the store link names them (a page
        id alone in a one-group pool, so its saves and loads are plain page ids)."""
        if self.num_groups == 1:
            return tables[0][first:first + count]
        return list(zip(*(table[first:first + count] for table in tables)))

    # --- internals ---
    def _blocks_spanned(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _new_blocks(self, seq: _SequenceBlocks, num_tokens: int) -> int:
        """New blocks per group (all groups' tables have the same length)."""
        return -(-(seq.num_tokens + num_tokens) // self.block_size) - len(seq.tables[0])

    def _needs_copy(self, seq: _SequenceBlocks, group: int = 0) -> bool:
        """Is the group's last block partial and shared, so that writing into it needs a copy?"""
        return seq.num_tokens % self.block_size != 0 and \
            self._pool.is_shared(seq.tables[group][-1])

    def _group_key(self, group: int) -> object:
        """The extra key of the group's hash chain. Group 0 keeps the plain one, so a
        single-group manager hashes exactly as a manager without groups."""
        return self.hash_extra_key if group == 0 else (self.hash_extra_key, "group", group)

    def _window_start(self, group: int, position: int) -> int:
        """Index of the first block a query at `position` (or later) reads in this group."""
        window = self.group_windows[group]
        if not window:
            return 0
        return max(0, position - window + 1) // self.block_size

    def _releasable(self, seq: _SequenceBlocks, group: int) -> range:
        """Table indices the group's window has left, once the sequence appends again."""
        return range(seq.released[group], self._window_start(group, seq.num_tokens))

    def _releasable_free(self, seq: _SequenceBlocks) -> int:
        """Blocks the next append's window release returns to the free pool (last holder)."""
        return sum(1 for g in self._sliding for i in self._releasable(seq, g)
                   if self._pool.ref_count(seq.tables[g][i]) == 1)

    def _release_outside_windows(self, seq: _SequenceBlocks) -> None:
        for g in self._sliding:
            span = self._releasable(seq, g)
            if not span:
                continue
            table = seq.tables[g]
            # Oldest first, so a chain's head queues (and is evicted) before its tail.
            for index in span:
                self._drop(table[index], g, self.block_size)
                table[index] = NULL_BLOCK
            seq.released[g] = span.stop
            self._logical_blocks -= len(span)
            self._window_released[g] += len(span)
            self._released_entries[g] += len(span)
            self.counters.window_released += len(span)

    def _count_released(self, released: list[int], sign: int) -> None:
        if self._sliding:
            for g in self._sliding:
                self._released_entries[g] += sign * released[g]

    def _allocate(self, group: int) -> int:
        block = self._pool.allocate()
        self._owner[block] = group
        self._group_used[group] += 1
        return block

    def _take_cached(self, block: int, group: int) -> None:
        """One more reference to a prefix-hit block (reviving it when it was cached free)."""
        if self._pool.ref_count(block) == 0:
            self._tokens_stored += self.block_size  # a cached block comes back into use
            self._group_used[group] += 1
        self._pool.incref(block)

    def _drop(self, block: int, group: int, fill: int) -> None:
        if self._pool.decref(block):
            self._tokens_stored -= fill
            self._group_used[group] -= 1

    def _blocks_for_group(self, seq_ids: SeqIds, num_tokens: int | abc.Sequence[int]) -> int:
        counts = _per_sequence_counts(seq_ids, num_tokens)
        total, writers = 0, Counter()
        for seq_id, count in zip(seq_ids, counts):
            seq = self._get(seq_id)
            if count:
                total += self._new_blocks(seq, count) * self.num_groups
                if self._sliding:
                    total -= self._releasable_free(seq)
                for g, table in enumerate(seq.tables):
                    if self._needs_copy(seq, g):
                        writers[table[-1]] += 1
        # k writers into a partial block with ref r copy min(k, r - 1) times: when all holders
        # write, the last one finds ref 1 and writes in place.
        return total + sum(min(k, self._pool.ref_count(b) - 1) for b, k in writers.items())

    def _copy_on_write(self, seq: _SequenceBlocks, group: int) -> None:
        table = seq.tables[group]
        source = table[-1]
        target = self._allocate(group)
        self._pool.decref(source)  # still held by the other branches (ref was > 1)
        table[-1] = target
        self._tokens_stored += self._block_fill(seq, len(table) - 1)
        self._pending_copies.append((source, target))
        self.counters.cow_copies += 1

    def _completed_block_hashes(self, seq: _SequenceBlocks, token_ids: tuple[int, ...],
                                group: int) -> list[BlockHash]:
        """Hashes of the blocks these tokens fill up, in the group's chain."""
        filled = len(seq.partial) + len(token_ids)
        if filled < self.block_size:
            return []
        pending = seq.partial + list(token_ids)
        return list(iter_block_hashes(pending, self.block_size, filled // self.block_size,
                                      self._group_key(group), seq.chain_hashes[group]))

    def _register_hashes(self, seq: _SequenceBlocks, token_ids: tuple[int, ...],
                         completed: list[list[BlockHash]]) -> None:
        first = seq.num_tokens // self.block_size
        for g, hashes in enumerate(completed):
            table = seq.tables[g]
            for offset, block_hash in enumerate(hashes):
                # A chunk longer than the window filled blocks it will release next step; they
                # are hashed all the same (a later prompt may hit them while they stay cached).
                self._pool.register_hash(table[first + offset], block_hash)
            if hashes:
                seq.chain_hashes[g] = hashes[-1].value
        if completed[0] and seq.store_key is not None:
            # Every group still holds these pages: a window releases a block at a later append.
            seq.store_key = self.store.filled(self._pages(seq.tables, first, len(completed[0])),
                                              seq.store_key, [h.token_ids for h in completed[0]])
        if completed[0]:
            # The new partial block holds only tokens of this call (a block was completed).
            remainder = (seq.num_tokens + len(token_ids)) % self.block_size
            seq.partial = list(token_ids[len(token_ids) - remainder:])
        else:
            seq.partial.extend(token_ids)

    def _no_hit(self) -> _PrefixHit:
        return _PrefixHit(0, [[] for _ in self.group_windows], [None] * self.num_groups)

    def _prefix_hits(self, token_ids: TokenIds) -> _PrefixHit:
        """The longest verified cached prefix, leaving the last token computed, and each
        group's entries for it. A full group needs all its blocks; a sliding group only those
        its window reads from the hit's end on (NULL_BLOCK before them)."""
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return self._no_hit()
        max_blocks = (len(token_ids) - 1) // self.block_size
        found: list[list[int | None]] = [[] for _ in self.group_windows]
        values: list[list[int]] = [[] for _ in self.group_windows]
        for g in self._full:
            self._lookup_chain(token_ids, max_blocks, g, found[g], values[g], stop_at_miss=True)
            max_blocks = min(max_blocks, len(found[g]))
        for g in self._sliding:
            self._lookup_chain(token_ids, max_blocks, g, found[g], values[g], stop_at_miss=False)
        hit = self._longest_hit(found, max_blocks)
        tables = []
        for g in range(self.num_groups):
            start = self._window_start(g, hit * self.block_size)
            tables.append([NULL_BLOCK] * start + list(found[g][start:hit]))
        # The chain continues from the hash *value* of the hit's last block, which a sliding
        # group may not hold (a window shorter than a block reads none of it).
        chains = [values[g][hit - 1] if hit else None for g in range(self.num_groups)]
        return _PrefixHit(hit, tables, chains)

    def _lookup_chain(self, token_ids: TokenIds, max_blocks: int, group: int,
                      blocks: list[int | None], values: list[int], stop_at_miss: bool) -> None:
        for block_hash in iter_block_hashes(token_ids, self.block_size, max_blocks,
                                            self._group_key(group)):
            block = self._pool.lookup(block_hash)
            if block is None and stop_at_miss:
                break
            blocks.append(block)
            values.append(block_hash.value)

    def _longest_hit(self, found: list[list[int | None]], max_blocks: int) -> int:
        """Largest h <= max_blocks at which every sliding group has its window's blocks."""
        runs = []  # per sliding group: length of the run of cached blocks ending at each index
        for g in self._sliding:
            run, length = [], 0
            for block in found[g]:
                length = length + 1 if block is not None else 0
                run.append(length)
            runs.append((g, run))
        for hit in range(max_blocks, 0, -1):
            if all(hit - self._window_start(g, hit * self.block_size) <= run[hit - 1]
                   for g, run in runs):
                return hit
        return 0

    def _block_fill(self, seq: _SequenceBlocks, index: int) -> int:
        return min(self.block_size, seq.num_tokens - index * self.block_size)

    def _require_free(self, needed: int, seq_id: int) -> None:
        available = self._pool.num_free
        if needed > available:
            raise NoFreeBlocksError(
                f"sequence {seq_id} needs {needed} free KV blocks but only {available} of "
                f"{self.num_blocks} are free", needed=needed, available=available,
                total=self.num_blocks)

    def _get(self, seq_id: int) -> _SequenceBlocks:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(
                f"unknown sequence id {seq_id!r} (never admitted or already freed)") from None

    def _require_new(self, seq_id: int, name: str) -> None:
        if not isinstance(seq_id, int):
            raise TypeError(f"{name} must be an int, got {seq_id!r}")
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"{name} {seq_id} is already registered")

    def _check_sequence(self, seq_id: int, seq: _SequenceBlocks, fills: dict[int, int]) -> None:
        expected = self._blocks_spanned(seq.num_tokens)
        if self.enable_prefix_caching:
            assert len(seq.partial) == seq.num_tokens % self.block_size, \
                f"sequence {seq_id}: partial-block tokens out of step"
        for g, table in enumerate(seq.tables):
            assert len(table) == expected, f"sequence {seq_id} covers {seq.num_tokens} tokens " \
                f"with {len(table)} blocks in group {g}, expected {expected}"
            released = seq.released[g]
            assert table[:released] == [NULL_BLOCK] * released and \
                NULL_BLOCK not in table[released:], \
                f"sequence {seq_id}, group {g}: released entries are not a leading run"
            # Released only what no query from the next position on reads.
            assert released <= self._window_start(g, seq.num_tokens), \
                f"sequence {seq_id}, group {g}: released a block its window still reads"
            for index in range(released, len(table)):
                block, fill = table[index], self._block_fill(seq, index)
                assert fills.setdefault(block, fill) == fill, \
                    f"block {block} is shared by tables that disagree on its fill"
                if self._pool.block_hash(block) is not None:
                    assert fill == self.block_size, f"partial block {block} carries a hash"


def _per_sequence_counts(seq_ids: SeqIds, num_tokens: int | abc.Sequence[int]) -> list[int]:
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"seq_ids must not repeat a sequence, got {list(seq_ids)!r}")
    if isinstance(num_tokens, int):
        counts = [num_tokens] * len(seq_ids)
    else:
        counts = list(num_tokens)
        if len(counts) != len(seq_ids):
            raise ValueError(f"num_tokens has {len(counts)} entries for {len(seq_ids)} seq_ids")
    for count in counts:
        require_int("num_tokens", count, 0)
    return counts
