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

Errors: bad use raises at once and changes nothing (`append_slots` checks capacity before it
mutates). Copy-on-write pairs must be applied in list order before the step's K/V are written.
"""

from __future__ import annotations

from collections import Counter, abc
from dataclasses import dataclass, field

from pagedgen.validation import require_int

from .block_hash import BlockHash, as_token_ids, iter_block_hashes
from .block_pool import BlockPool
from .kv_types import (
    DuplicateSequenceError, KVCounters, NoFreeBlocksError, PoolSnapshot, UnknownSequenceError,
)

# Read-only int sequences (lists, tuples). Spelled abc.Sequence, never bare: in the engine
# `Sequence` is the generated sequence (sequence.py).
TokenIds = abc.Sequence[int]
SeqIds = abc.Sequence[int]


@dataclass(slots=True)
class _SequenceBlocks:
    """What the manager knows about one sequence."""

    table: list[int]
    num_tokens: int  # tokens covered by the table
    chain_hash: int | None = None  # hash value of its last full block: the next block's parent
    partial: list[int] = field(default_factory=list)  # tokens of the unfilled last block


class KVCacheManager:
    __slots__ = (
        "block_size", "num_blocks", "enable_prefix_caching", "hash_extra_key", "counters",
        "_pool", "_seqs", "_pending_copies", "_logical_blocks", "_tokens_stored",
    )

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_extra_key: object = None) -> None:
        require_int("num_blocks", num_blocks)
        require_int("block_size", block_size)
        try:
            hash(hash_extra_key)
        except TypeError:
            raise TypeError(f"hash_extra_key must be hashable, got {hash_extra_key!r}") from None
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hash_extra_key = hash_extra_key
        self.counters = KVCounters()
        self._pool = BlockPool(num_blocks, self.counters)
        self._seqs: dict[int, _SequenceBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._logical_blocks = 0
        self._tokens_stored = 0

    # --- side-effect-free questions ---
    def num_cached_prefix_tokens(self, token_ids: TokenIds) -> int:
        return len(self._prefix_hits(token_ids)) * self.block_size

    def can_admit(self, token_ids: TokenIds, num_new_tokens: int) -> bool:
        """Would `admit(token_ids)` then `append_slots` of `num_new_tokens` tokens (right after
        the cached prefix) succeed now? A hit on a cached free block uses up a free block."""
        require_int("num_new_tokens", num_new_tokens, 0)
        hits = self._prefix_hits(token_ids)
        covered = len(hits) * self.block_size + num_new_tokens
        if self._blocks_spanned(max(len(token_ids), covered)) > self.num_blocks:
            return False
        revived = sum(1 for block in hits if self._pool.ref_count(block) == 0)
        new_blocks = self._blocks_spanned(covered) - len(hits)
        return revived + new_blocks <= self._pool.num_free

    def can_append(self, seq_ids: SeqIds, num_tokens: int | abc.Sequence[int]) -> bool:
        """Can every listed sequence append its tokens, one after another, right now?"""
        return self._blocks_for_group(seq_ids, num_tokens) <= self._pool.num_free

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached free included)."""
        return self._pool.num_free

    def blocks_to_append(self, seq_id: int, num_tokens: int) -> int:
        require_int("num_tokens", num_tokens, 0)
        seq = self._get(seq_id)
        if num_tokens == 0:
            return 0
        return self._new_blocks(seq, num_tokens) + self._needs_copy(seq)

    def blocks_freed_by(self, seq_ids: SeqIds) -> int:
        """Blocks whose every reference comes from these sequences (freed if they all went)."""
        holds: Counter[int] = Counter()
        for seq_id in set(seq_ids):
            holds.update(self._get(seq_id).table)
        return sum(1 for block, count in holds.items() if count == self._pool.ref_count(block))

    # --- mutations ---
    def admit(self, seq_id: int, token_ids: TokenIds, use_prefix_cache: bool = True) -> int:
        """Register a sequence and take its prefix-cache hits (unless use_prefix_cache is False:
        every token is then computed again); returns the tokens served."""
        self._require_new(seq_id, "seq_id")
        needed = self._blocks_spanned(len(token_ids))
        if needed > self.num_blocks:
            raise NoFreeBlocksError(
                f"a prompt of {len(token_ids)} tokens needs {needed} KV blocks of "
                f"{self.block_size} tokens but the pool has only {self.num_blocks} blocks; "
                "give the KV cache more memory or shorten the prompt",
                needed=needed, available=self._pool.num_free, total=self.num_blocks)
        hits = self._prefix_hits(token_ids) if use_prefix_cache else []
        for block in hits:
            if self._pool.ref_count(block) == 0:
                self._tokens_stored += self.block_size  # a cached block comes back into use
            self._pool.incref(block)
        chain_hash = self._pool.block_hash(hits[-1]).value if hits else None
        self._seqs[seq_id] = _SequenceBlocks(hits, len(hits) * self.block_size, chain_hash)
        self._logical_blocks += len(hits)
        if self.enable_prefix_caching:
            self.counters.prefix_query_tokens += len(token_ids)
            self.counters.prefix_hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def append_slots(self, seq_id: int, token_ids: TokenIds) -> None:
        """Reserve slots for the tokens computed this step (see contract); atomic on error."""
        # Called for every running sequence every step: the common decode case (no new block,
        # no copy, no full block) stays free of allocations and extra calls.
        seq = self._get(seq_id)
        count = len(token_ids)
        if count == 0:
            return
        needs_copy = self._needs_copy(seq)
        new_blocks = self._new_blocks(seq, count)
        if needs_copy or new_blocks:
            self._require_free(new_blocks + needs_copy, seq_id)
        # Check and hash the tokens before mutating: the only step left that can raise.
        if self.enable_prefix_caching:
            token_ids = as_token_ids(token_ids)
            completed = self._completed_block_hashes(seq, token_ids)
        if needs_copy:
            self._copy_on_write(seq)
        if new_blocks:
            seq.table.extend([self._pool.allocate() for _ in range(new_blocks)])
            self._logical_blocks += new_blocks
        self._tokens_stored += count
        if self.enable_prefix_caching:
            self._register_hashes(seq, token_ids, completed)
        seq.num_tokens += count

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._get(parent_id)
        self._require_new(child_id, "child_id")
        for block in parent.table:
            self._pool.incref(block)
        self._seqs[child_id] = _SequenceBlocks(
            list(parent.table), parent.num_tokens, parent.chain_hash, list(parent.partial))
        self._logical_blocks += len(parent.table)

    def free(self, seq_id: int) -> None:
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        table = seq.table
        self._logical_blocks -= len(table)
        # Tail first: freed hashed blocks queue up in this order, so the tail is evicted first.
        for index in range(len(table) - 1, -1, -1):
            if self._pool.decref(table[index]):
                self._tokens_stored -= self._block_fill(seq, index)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) pairs recorded since the last call, in the order to apply."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # --- reading ---
    def block_table(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id).table)

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).num_tokens

    def slot(self, seq_id: int, token_index: int) -> int:
        seq = self._get(seq_id)
        if not (isinstance(token_index, int) and 0 <= token_index < seq.num_tokens):
            raise IndexError(
                f"token_index must be in [0, {seq.num_tokens}) for sequence {seq_id}, "
                f"got {token_index!r}")
        block_index, offset = divmod(token_index, self.block_size)
        return seq.table[block_index] * self.block_size + offset

    def snapshot(self) -> PoolSnapshot:
        pool = self._pool
        return PoolSnapshot(
            num_blocks=self.num_blocks, blocks_used=pool.num_used, blocks_free=pool.num_free,
            blocks_cached_free=pool.num_cached_free, blocks_shared=pool.num_shared,
            logical_blocks=self._logical_blocks, tokens_stored=self._tokens_stored)

    def block_tables(self) -> dict[int, list[int]]:
        return {seq_id: list(seq.table) for seq_id, seq in self._seqs.items()}

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
        """Recount everything from the tables; raises AssertionError naming what is wrong."""
        self._pool.check_integrity()
        fills: dict[int, int] = {}
        for seq_id, seq in self._seqs.items():
            self._check_sequence(seq_id, seq, fills)
        holds = Counter(block for seq in self._seqs.values() for block in seq.table)
        for block in range(self.num_blocks):
            ref = self._pool.ref_count(block)
            assert ref == holds[block], f"block {block}: ref count {ref} but {holds[block]} " \
                "table entries"
        entries = sum(holds.values())
        assert self._logical_blocks == entries, f"logical_blocks {self._logical_blocks} != {entries}"
        assert self._tokens_stored == sum(fills.values()), \
            f"tokens_stored {self._tokens_stored} != recount {sum(fills.values())}"
        assert self._pool.num_used == len(holds), "used block count differs from the tables"

    # --- internals ---
    def _blocks_spanned(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _new_blocks(self, seq: _SequenceBlocks, num_tokens: int) -> int:
        return -(-(seq.num_tokens + num_tokens) // self.block_size) - len(seq.table)

    def _needs_copy(self, seq: _SequenceBlocks) -> bool:
        """Is the last block partial and shared, so that writing into it needs a copy?"""
        return seq.num_tokens % self.block_size != 0 and self._pool.is_shared(seq.table[-1])

    def _blocks_for_group(self, seq_ids: SeqIds, num_tokens: int | abc.Sequence[int]) -> int:
        counts = _per_sequence_counts(seq_ids, num_tokens)
        total, writers = 0, Counter()
        for seq_id, count in zip(seq_ids, counts):
            seq = self._get(seq_id)
            if count:
                total += self._new_blocks(seq, count)
                if self._needs_copy(seq):
                    writers[seq.table[-1]] += 1
        # k writers into a partial block with ref r copy min(k, r - 1) times: when all holders
        # write, the last one finds ref 1 and writes in place.
        return total + sum(min(k, self._pool.ref_count(b) - 1) for b, k in writers.items())

    def _copy_on_write(self, seq: _SequenceBlocks) -> None:
        source = seq.table[-1]
        target = self._pool.allocate()
        self._pool.decref(source)  # still held by the other branches (ref was > 1)
        seq.table[-1] = target
        self._tokens_stored += self._block_fill(seq, len(seq.table) - 1)
        self._pending_copies.append((source, target))
        self.counters.cow_copies += 1

    def _completed_block_hashes(self, seq: _SequenceBlocks,
                                token_ids: tuple[int, ...]) -> list[BlockHash]:
        """Hashes of the blocks these tokens fill up."""
        filled = len(seq.partial) + len(token_ids)
        if filled < self.block_size:
            return []
        pending = seq.partial + list(token_ids)
        return list(iter_block_hashes(pending, self.block_size, filled // self.block_size,
                                      self.hash_extra_key, seq.chain_hash))

    def _register_hashes(self, seq: _SequenceBlocks, token_ids: tuple[int, ...],
                         completed: list[BlockHash]) -> None:
        first = seq.num_tokens // self.block_size
        for offset, block_hash in enumerate(completed):
            self._pool.register_hash(seq.table[first + offset], block_hash)
        if completed:
            # The new partial block holds only tokens of this call (a block was completed).
            remainder = (seq.num_tokens + len(token_ids)) % self.block_size
            seq.chain_hash = completed[-1].value
            seq.partial = list(token_ids[len(token_ids) - remainder:])
        else:
            seq.partial.extend(token_ids)

    def _prefix_hits(self, token_ids: TokenIds) -> list[int]:
        """Blocks serving the longest verified cached prefix, leaving the last token computed."""
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits = []
        for block_hash in iter_block_hashes(token_ids, self.block_size, max_blocks,
                                            self.hash_extra_key):
            block = self._pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

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
        assert len(seq.table) == expected, f"sequence {seq_id} covers {seq.num_tokens} tokens " \
            f"with {len(seq.table)} blocks, expected {expected}"
        if self.enable_prefix_caching:
            assert len(seq.partial) == seq.num_tokens % self.block_size, \
                f"sequence {seq_id}: partial-block tokens out of step"
        for index, block in enumerate(seq.table):
            fill = self._block_fill(seq, index)
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
