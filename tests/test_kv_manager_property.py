"""Random admit / append / fork / free / prefix hits / eviction against a simple reference model.

The reference stores what the rules say in the plainest way — every sequence's full token list,
a prefix key per cached block made of *all* tokens up to it (no hashing), O(n) scans for every
choice — and answers the capacity questions by trying the mutation on a deep copy. The manager
must agree on every block table, ref count, cached flag, snapshot field, counter and copy.
"""

import copy
import dataclasses
import random

from hypothesis import settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule,
)

from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.engine.kv_types import KVCounters, NoFreeBlocksError, PoolSnapshot

EXTRA_KEY = "salt"
BASES = [[random.Random(k).randrange(3) for _ in range(128)] for k in range(3)]


class ReferenceKV:
    """The rules, spelled out with dicts and scans.

    Allocation preference (documented in block_pool.py): a plain recycled block, most recently
    released first; else the lowest never-used block; else the cached block released longest ago
    (it loses its key: an eviction).
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.n, self.b, self.caching = num_blocks, block_size, caching
        self.ref = {block: 0 for block in range(num_blocks)}
        self.key: dict[int, tuple | None] = {block: None for block in range(num_blocks)}
        self.never_used = set(range(num_blocks))
        self.released_at: dict[int, int] = {}
        self.clock = 0
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.copies: list[tuple[int, int]] = []
        self.counters = KVCounters()

    # --- mutations ---
    def admit(self, seq: int, prompt: list[int]) -> int:
        if -(-len(prompt) // self.b) > self.n:
            raise NoFreeBlocksError("prompt never fits", 0, 0, self.n)
        hits = self.prefix_hits(prompt)
        for block in hits:
            self.ref[block] += 1
            self.released_at.pop(block, None)
        self.tables[seq] = hits
        self.tokens[seq] = prompt[:len(hits) * self.b]
        if self.caching:
            self.counters.prefix_query_tokens += len(prompt)
            self.counters.prefix_hit_tokens += len(hits) * self.b
        return len(hits) * self.b

    def append(self, seq: int, new_tokens: list[int]) -> None:
        table, tokens = self.tables[seq], self.tokens[seq]
        if not new_tokens:
            return
        copy_needed = len(tokens) % self.b != 0 and self.ref[table[-1]] > 1
        grow = -(-(len(tokens) + len(new_tokens)) // self.b) - len(table)
        if copy_needed + grow > self.num_free():
            raise NoFreeBlocksError("full", 0, 0, self.n)
        if copy_needed:
            target = self.allocate()
            self.ref[table[-1]] -= 1
            self.copies.append((table[-1], target))
            self.counters.cow_copies += 1
            table[-1] = target
        table.extend(self.allocate() for _ in range(grow))
        before = len(tokens) // self.b
        tokens.extend(new_tokens)
        for index in range(before, len(tokens) // self.b):
            self.register(table[index], tokens[:(index + 1) * self.b])

    def fork(self, parent: int, child: int) -> None:
        self.tables[child] = list(self.tables[parent])
        self.tokens[child] = list(self.tokens[parent])
        for block in self.tables[child]:
            self.ref[block] += 1

    def free(self, seq: int) -> None:
        for block in reversed(self.tables.pop(seq)):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.released_at[block] = self.clock
                self.clock += 1
                self.counters.blocks_freed += 1
        del self.tokens[seq]

    # --- helpers ---
    def allocate(self) -> int:
        free = [block for block in range(self.n) if self.ref[block] == 0]
        plain = [b for b in free if b not in self.never_used and self.key[b] is None]
        if plain:
            block = max(plain, key=self.released_at.__getitem__)
        elif self.never_used:
            block = min(self.never_used)
            self.never_used.discard(block)
        else:
            block = min(free, key=self.released_at.__getitem__)
            self.key[block] = None
            self.counters.evictions += 1
        self.released_at.pop(block, None)
        self.ref[block] = 1
        self.counters.blocks_allocated += 1
        return block

    def register(self, block: int, prefix: list[int]) -> None:
        key = (EXTRA_KEY, tuple(prefix))
        if self.caching and key not in self.key.values():
            self.key[block] = key

    def prefix_hits(self, prompt: list[int]) -> list[int]:
        hits = []
        for index in range((len(prompt) - 1) // self.b if self.caching else 0):
            key = (EXTRA_KEY, tuple(prompt[:(index + 1) * self.b]))
            matches = [block for block, k in self.key.items() if k == key]
            if not matches:
                break
            hits.append(matches[0])
        return hits

    def num_free(self) -> int:
        return sum(1 for ref in self.ref.values() if ref == 0)

    def cached_free_blocks(self) -> list[int]:
        cached = [b for b in range(self.n) if self.ref[b] == 0 and self.key[b] is not None]
        return sorted(cached, key=self.released_at.__getitem__)  # the next eviction first

    def snapshot(self) -> PoolSnapshot:
        fills = {}
        for seq, table in self.tables.items():
            for index, block in enumerate(table):
                fills[block] = min(self.b, len(self.tokens[seq]) - index * self.b)
        return PoolSnapshot(
            num_blocks=self.n, blocks_used=self.n - self.num_free(), blocks_free=self.num_free(),
            blocks_cached_free=sum(1 for b in range(self.n) if self.ref[b] == 0 and self.key[b]),
            blocks_shared=sum(1 for ref in self.ref.values() if ref > 1),
            logical_blocks=sum(map(len, self.tables.values())), tokens_stored=sum(fills.values()))

    # --- capacity questions answered by trying ---
    def succeeds(self, action) -> bool:
        trial = copy.deepcopy(self)
        try:
            action(trial)
        except NoFreeBlocksError:
            return False
        return True

    def frees(self, seqs) -> int:
        trial = copy.deepcopy(self)
        for seq in seqs:
            trial.free(seq)
        return trial.counters.blocks_freed - self.counters.blocks_freed


class KVMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 14), block_size=st.sampled_from([1, 2, 4]),
                caching=st.booleans())
    def build(self, num_blocks, block_size, caching):
        self.kv = KVCacheManager(num_blocks, block_size, caching, hash_extra_key=EXTRA_KEY)
        self.ref = ReferenceKV(num_blocks, block_size, caching)
        self.scripts: dict[int, list[int]] = {}  # the tokens each sequence goes on to write
        self.next_id = 0

    def live(self) -> list[int]:
        return sorted(self.scripts)

    def next_tokens(self, seq: int, count: int) -> list[int]:
        start = self.kv.num_tokens(seq)
        return self.scripts[seq][start:start + count]

    @rule(base=st.integers(0, 2), length=st.integers(1, 24), chunk=st.integers(0, 24),
          edit=st.none() | st.tuples(st.integers(0, 127), st.integers(0, 2)))
    def admit(self, base, length, chunk, edit):
        script = list(BASES[base])
        if edit:
            script[edit[0]] = edit[1]
        prompt, seq = script[:length], self.next_id
        assert self.kv.num_cached_prefix_tokens(prompt) == len(self.ref.prefix_hits(prompt)) * self.ref.b
        hit = len(self.ref.prefix_hits(prompt)) * self.ref.b
        chunk = min(chunk, length - hit)
        for size in range(length - hit + 1):  # can_admit must flip exactly where it stops fitting
            fits = self.ref.succeeds(
                lambda r: (r.admit(seq, prompt), r.append(seq, prompt[hit:hit + size])))
            assert self.kv.can_admit(prompt, size) == fits, f"can_admit(prompt, {size})"
        if not self.ref.succeeds(lambda r: r.admit(seq, prompt)):
            self.expect_failure(lambda: self.kv.admit(seq, prompt))
            return
        assert self.kv.admit(seq, prompt) == self.ref.admit(seq, prompt) == hit
        self.next_id += 1
        self.scripts[seq] = script
        self.append_checked(seq, prompt[hit:hit + chunk])

    @precondition(lambda self: self.scripts)
    @rule(data=st.data(), count=st.integers(0, 6))
    def append(self, data, count):
        seq = data.draw(st.sampled_from(self.live()))
        tokens = self.next_tokens(seq, count)
        allocated = self.kv.counters.blocks_allocated
        needed = self.kv.blocks_to_append(seq, len(tokens))
        if self.append_checked(seq, tokens):
            assert self.kv.counters.blocks_allocated - allocated == needed
        else:
            assert needed > self.kv.snapshot().blocks_free

    @precondition(lambda self: len(self.scripts) >= 2)
    @rule(data=st.data())
    def append_group(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.live()), min_size=2, max_size=4, unique=True))
        self.append_batch(data, seqs)

    @precondition(lambda self: self.scripts)
    @rule(data=st.data())
    def append_siblings(self, data):
        """All holders of one (possibly shared, partial) last block write at once."""
        tables = self.kv.block_tables()
        last = tables[data.draw(st.sampled_from(self.live()))][-1:]
        self.append_batch(data, [seq for seq in self.live() if tables[seq][-1:] == last])

    def append_batch(self, data, seqs: list[int]) -> None:
        counts = data.draw(st.lists(st.integers(0, 5), min_size=len(seqs), max_size=len(seqs)))
        # Sweep the first sequence's demand so the answer crosses the pool's edge.
        for first in range(0, 41, max(1, self.ref.b // 2)):
            self.check_can_append(seqs, [first, *counts[1:]])
        batch = [(seq, self.next_tokens(seq, count)) for seq, count in zip(seqs, counts)]
        for seq, tokens in batch:
            if not self.append_checked(seq, tokens):
                break

    @precondition(lambda self: self.scripts)
    @rule(data=st.data(), edit=st.integers(0, 2))
    def fork(self, data, edit):
        parent, child = data.draw(st.sampled_from(self.live())), self.next_id
        self.next_id += 1
        self.kv.fork(parent, child)
        self.ref.fork(parent, child)
        script = list(self.scripts[parent])
        position = self.kv.num_tokens(parent)
        if position < len(script):
            script[position] = edit  # the branches (may) diverge at the next token
        self.scripts[child] = script

    @precondition(lambda self: self.scripts)
    @rule(data=st.data())
    def free(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=3, unique=True))
        assert self.kv.blocks_freed_by(seqs) == self.ref.frees(seqs)
        seq = seqs[0]
        expected = self.ref.frees([seq])
        before = self.kv.counters.blocks_freed
        self.kv.free(seq)
        self.ref.free(seq)
        del self.scripts[seq]
        assert self.kv.counters.blocks_freed - before == expected

    @rule()
    def take_copies(self):
        assert self.kv.take_pending_copies() == self.ref.copies
        self.ref.copies = []

    def check_can_append(self, seqs: list[int], counts: list[int]) -> None:
        batch = [(seq, self.next_tokens(seq, count)) for seq, count in zip(seqs, counts)]
        fits = self.ref.succeeds(lambda r: [r.append(s, t) for s, t in batch])
        assert self.kv.can_append(seqs, [len(t) for _, t in batch]) == fits, batch

    def append_checked(self, seq: int, tokens: list[int]) -> bool:
        if not self.ref.succeeds(lambda r: r.append(seq, tokens)):
            self.expect_failure(lambda: self.kv.append_slots(seq, tokens))
            return False
        self.kv.append_slots(seq, tokens)
        self.ref.append(seq, tokens)
        return True

    def expect_failure(self, action) -> None:
        before = (self.kv.snapshot(), self.kv.block_tables(), dataclasses.astuple(self.kv.counters))
        try:
            action()
        except NoFreeBlocksError:
            pass
        else:
            raise AssertionError("expected NoFreeBlocksError")
        after = (self.kv.snapshot(), self.kv.block_tables(), dataclasses.astuple(self.kv.counters))
        assert after == before, "a failed call changed the manager"

    @invariant()
    def agrees_with_reference(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_integrity()
        assert self.kv.block_tables() == self.ref.tables
        assert self.kv.snapshot() == self.ref.snapshot()
        assert self.kv.counters == self.ref.counters
        assert self.kv.cached_free_blocks() == self.ref.cached_free_blocks()
        for block in range(self.ref.n):
            assert self.kv.ref_count(block) == self.ref.ref[block]
            assert self.kv.is_cached(block) == (self.ref.key[block] is not None)
        for seq in self.ref.tables:
            assert self.kv.num_tokens(seq) == len(self.ref.tokens[seq])


KVMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestKVManagerAgainstReference = KVMachine.TestCase
