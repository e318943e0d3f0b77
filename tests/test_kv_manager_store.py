"""KVCacheManager + the prefix store on layer groups: what a warm admission takes from the store.

A stored block is its page in every layer group. After the memory hits, a full group takes every
stored block up to the hit's end; a sliding group only the pages of its window in front of that
end (NULL_BLOCK before, memory hits included). Payloads here are the block's index, so every load
names the block it came from. B = 4, windows of 8 and 13 tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from pagedgen.engine.kv_manager import NULL_BLOCK, KVCacheManager
from pagedgen.engine.prefix_store import BlockStore, block_keys
from pagedgen.engine.store_link import StoreLink
from test_kv_groups_property import GroupedKVMachine

B = 4
ROOT = b"r" * 32
TOKENS = list(range(100, 140))  # 10 full blocks; a hit ends at block 9 (the last token computed)
HYBRID = (0, 8)                 # a full group and a sliding one


def link(store: BlockStore, num_blocks: int = 64) -> StoreLink:
    return StoreLink(store, ROOT, num_blocks, B, payload_size=8)


def manager(store: BlockStore, windows: tuple[int, ...], num_blocks: int = 64) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, B, hash_extra_key="m", group_windows=windows)
    kv.attach_store(link(store, num_blocks))
    return kv


@pytest.fixture
def store(tmp_path) -> BlockStore:
    return BlockStore(tmp_path / "s", min_free_bytes=0)


def write_prompt(store: BlockStore, windows: tuple[int, ...], tokens: list[int] = TOKENS) -> list:
    """A cold run of the prompt: every full block is saved (sliding groups' ones included, all
    groups' pages present), its payload the block's index. Returns the saves."""
    kv = manager(store, windows)
    kv.admit(0, tokens)
    kv.append_slots(0, tokens)
    saves = kv.store.take_saves()
    assert [key for _, key in saves] == list(block_keys(ROOT, tokens, B, len(tokens) // B))
    for index, (_, key) in enumerate(saves):
        store.write(key, index.to_bytes(8, "little"))
    return saves


def loaded(kv: KVCacheManager) -> list[tuple[object, int]]:
    return [(pages, int.from_bytes(payload, "little")) for pages, payload in kv.store.take_loads()]


def window_start(window: int, position: int) -> int:
    return max(0, position - window + 1) // B


def test_a_saved_block_names_its_page_in_every_group(store):
    kv = manager(store, HYBRID)
    kv.admit(0, TOKENS[:20])
    kv.append_slots(0, TOKENS[:20])
    tables = kv.group_block_tables(0)
    assert [pages for pages, _ in kv.store.take_saves()] == list(zip(*tables))


def test_hybrid_pool_copies_in_the_full_groups_pages_and_only_the_sliding_window(store):
    write_prompt(store, HYBRID)
    kv = manager(store, HYBRID)
    assert kv.num_cached_prefix_tokens(TOKENS) == 36
    assert kv.admit(1, TOKENS) == 36
    full, sliding = kv.group_block_tables(1)
    start = window_start(8, 36)  # 7: the window in front of token 36 starts in block 7
    assert NULL_BLOCK not in full and len(full) == 9
    assert sliding[:start] == [NULL_BLOCK] * start and NULL_BLOCK not in sliding[start:]
    # Every stored block is read (the full group needs it); the sliding part only in the window.
    assert loaded(kv) == [((full[i], sliding[i]), i) for i in range(9)]
    assert kv.snapshot().groups[1].released_entries == start
    assert kv.store.counters.hit_blocks == 9
    kv.append_slots(1, TOKENS[36:] + [7])  # fills block 9: saved, chained after the loaded ones
    kv.check_integrity()
    (pages, key), = kv.store.take_saves()
    assert pages == (kv.block_table(1)[9], kv.block_table(1, 1)[9])
    assert key == list(block_keys(ROOT, TOKENS, B, 10))[9]


@pytest.mark.parametrize("free", [13, 12])
def test_can_admit_counts_only_the_window_pages_a_store_hit_takes(store, free):
    """Hit at block 9 then 4 new tokens: 9 + 1 full pages, 2 + 1 sliding pages = 13."""
    write_prompt(store, HYBRID)
    kv = manager(store, HYBRID, num_blocks=20)
    other = list(range(900, 912))  # 3 blocks in each group, 6 pages, no hit
    kv.admit(5, other)
    kv.append_slots(5, other)
    kv.store.take_saves()
    for _ in range(20 - 6 - free):
        kv.append_slots(5, [1] * B)  # one more page each (the window gives back as many)
    assert kv.num_free_blocks == free
    assert kv.can_admit(TOKENS, 4) == (free >= 13)
    if free >= 13:
        kv.admit(1, TOKENS)
        kv.append_slots(1, TOKENS[36:])
        assert kv.num_free_blocks == free - 13
        kv.check_integrity()


def test_memory_hits_the_longer_windows_no_longer_read_are_not_taken(store):
    write_prompt(store, HYBRID)
    kv = manager(store, HYBRID)
    kv.admit(0, TOKENS[:17], use_prefix_cache=False)  # blocks 0-3 computed in both groups
    kv.append_slots(0, TOKENS[:17])
    kv.store.take_saves()
    memory_sliding = kv.group_block_tables(0)[1][:4]
    kv.free(0)  # they stay cached in memory
    assert kv.admit(1, TOKENS) == 36
    assert kv.counters.prefix_hit_tokens == 16  # memory: blocks 0-3; the store: 4-8
    assert kv.store.counters.hit_blocks == 5
    full, sliding = kv.group_block_tables(1)
    assert sliding[:7] == [NULL_BLOCK] * 7
    assert all(kv.ref_count(block) == 0 for block in memory_sliding)  # still cached free
    assert [i for _, i in loaded(kv)] == [4, 5, 6, 7, 8]
    kv.check_integrity()


def test_a_damaged_block_ends_the_hit_before_it(store):
    write_prompt(store, HYBRID)
    key = list(block_keys(ROOT, TOKENS, B, 6))[5]
    store.path_of(key).write_bytes(b"torn")
    kv = manager(store, HYBRID)
    assert kv.num_cached_prefix_tokens(TOKENS) == 36  # the file is there until it is read
    with pytest.warns(Warning, match="unusable"):
        assert kv.admit(1, TOKENS) == 20
    full, sliding = kv.group_block_tables(1)
    start = window_start(8, 20)
    assert len(full) == 5 and NULL_BLOCK not in full
    assert sliding[:start] == [NULL_BLOCK] * start and NULL_BLOCK not in sliding[start:]
    assert [i for _, i in loaded(kv)] == [0, 1, 2, 3, 4]
    assert store.counters.bad_removed == 1 and not store.path_of(key).exists()
    kv.append_slots(1, TOKENS[20:])
    kv.check_integrity()


def test_a_damaged_block_in_an_all_sliding_window_moves_the_hit_before_it(store):
    """Block 8 torn: the hit ending at block 9 needs it; the one ending at block 8 reads blocks
    6 and 7, read back whole."""
    write_prompt(store, (8,))
    store.path_of(list(block_keys(ROOT, TOKENS, B, 9))[8]).write_bytes(b"torn")
    kv = manager(store, (8,))
    with pytest.warns(Warning, match="unusable"):
        assert kv.admit(1, TOKENS) == 32
    table = kv.block_table(1)
    assert table[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in table[6:]
    assert loaded(kv) == [(table[6], 6), (table[7], 7)]
    kv.append_slots(1, TOKENS[32:])
    kv.check_integrity()


@pytest.mark.parametrize("windows", [(8,), (8, 13)])
def test_an_all_sliding_pool_serves_a_hit_whose_early_blocks_the_store_lost(store, windows):
    write_prompt(store, windows)
    starts = [window_start(w, 36) for w in windows]  # 7, and 6 for the 13-token window
    for key in list(block_keys(ROOT, TOKENS, B, min(starts))):
        store.path_of(key).unlink()
    kv = manager(store, windows)
    assert kv.num_cached_prefix_tokens(TOKENS) == 36
    assert kv.admit(1, TOKENS) == 36
    tables = kv.group_block_tables(1)
    for table, start in zip(tables, starts):
        assert table[:start] == [NULL_BLOCK] * start and NULL_BLOCK not in table[start:]
    expected_pages = [tuple(t[i] for t in tables) for i in range(min(starts), 9)]
    if len(windows) == 1:
        expected_pages = [pages for pages, in expected_pages]
    assert loaded(kv) == list(zip(expected_pages, range(min(starts), 9)))
    assert kv.store.counters.hit_blocks == 9  # served; only the windows' ones were read
    kv.append_slots(1, TOKENS[36:])
    kv.check_integrity()


def test_an_all_sliding_pool_ends_its_hit_where_a_window_misses_a_block(store):
    """Block 7 lost: the hits ending at blocks 9 and 8 read it (their windows start at blocks 7
    and 6); the longest that does without it ends at block 7 and reads blocks 5 and 6."""
    write_prompt(store, (8,))
    store.path_of(list(block_keys(ROOT, TOKENS, B, 8))[7]).unlink()
    kv = manager(store, (8,))
    assert kv.num_cached_prefix_tokens(TOKENS) == 28
    assert kv.admit(1, TOKENS) == 28
    assert [i for _, i in loaded(kv)] == [5, 6]
    kv.append_slots(1, TOKENS[28:])
    kv.check_integrity()


# --- random admissions against what the kernels would read, with a store behind the pool ---


class _DictStore:
    """The BlockStore calls the link makes, over a dict; a damaged block is removed on read."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, list] = {}
        self.damaged: set[bytes] = set()

    def contains(self, key: bytes) -> bool:
        return key in self.blocks

    def read(self, key: bytes, payload_size: int | None = None):
        if key in self.damaged:
            self.damaged.discard(key)
            del self.blocks[key]
            return None
        return self.blocks.get(key)


class StoredGroupedKVMachine(GroupedKVMachine):
    """The grouped-pool machine (test_kv_groups_property.py) with a store: every saved block's
    pages are snapshot (what the engine copies out after the step), every load writes the
    snapshot into the pages it names, and blocks are lost or damaged at random. Its invariant,
    that every group reads its own prefix wherever its window reads, holds for store hits too."""

    @initialize(num_blocks=st.integers(6, 40), block_size=st.sampled_from([1, 2, 4]),
                windows=st.lists(st.sampled_from([0, 0, 1, 3, 5, 8]), min_size=1, max_size=3))
    def build(self, num_blocks, block_size, windows):
        GroupedKVMachine.build.__wrapped__(self, num_blocks, block_size, windows, True)
        self.store = _DictStore()
        self.kv.attach_store(StoreLink(self.store, ROOT, num_blocks, block_size))

    @precondition(lambda self: self.store.blocks)
    @rule()
    def next_run(self):
        """A new run over the same store: nothing in memory, every hit comes from disk."""
        num_blocks = self.kv.num_blocks
        GroupedKVMachine.build.__wrapped__(self, num_blocks, self.b, self.windows, True)
        self.kv.attach_store(StoreLink(self.store, ROOT, num_blocks, self.b))

    def append(self, seq: int, count: int) -> bool:
        self.copy_in_loads()
        grew = super().append(seq, count)
        for pages, key in self.kv.store.take_saves():
            self.store.blocks[key] = [[self.pages.get((g, page * self.b + offset))
                                       for offset in range(self.b)]
                                      for g, page in enumerate(self.group_pages(pages))]
        return grew

    def copy_in_loads(self) -> None:
        for pages, payload in self.kv.store.take_loads():
            for g, page in enumerate(self.group_pages(pages)):
                if page != NULL_BLOCK:
                    for offset in range(self.b):
                        self.pages[(g, page * self.b + offset)] = payload[g][offset]

    @staticmethod
    def group_pages(pages) -> tuple[int, ...]:
        return pages if isinstance(pages, tuple) else (pages,)

    @precondition(lambda self: self.store.blocks)
    @rule(data=st.data(), damage=st.booleans())
    def lose_a_block(self, data, damage):
        key = data.draw(st.sampled_from(sorted(self.store.blocks)))
        if damage:
            self.store.damaged.add(key)
        else:
            del self.store.blocks[key]
            self.store.damaged.discard(key)

    @invariant()
    def no_load_is_left_behind(self):
        if hasattr(self, "kv"):
            assert not self.kv.store._loads, "an admission's loads were not copied in"


StoredGroupedKVMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30,
                                                    deadline=None)
TestStoredGroupedKVManager = StoredGroupedKVMachine.TestCase
