"""BlockPool: ref counts, the O(1) free queue, its allocation order, the hash registry."""

import time

import pytest

from pagedgen.engine.block_hash import BlockHash, hash_block, iter_block_hashes
from pagedgen.engine.block_pool import BlockPool
from pagedgen.engine.kv_types import BlockStateError, NoFreeBlocksError


def full_block(pool: BlockPool, tokens: tuple[int, ...], parent: int | None = None) -> int:
    block = pool.allocate()
    assert pool.register_hash(block, hash_block(parent, tokens, None))
    return block


def test_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(4)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert (pool.num_used, pool.num_free) == (4, 0)
    with pytest.raises(NoFreeBlocksError, match="all 4 blocks are in use"):
        pool.allocate()
    pool.check_integrity()


def test_plain_freed_blocks_are_reused_most_recent_first_before_fresh_ones():
    pool = BlockPool(6)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.decref(a)
    pool.decref(c)
    assert pool.free_queue() == [c, a]
    assert [pool.allocate() for _ in range(3)] == [c, a, 3]
    pool.check_integrity()


def test_cached_blocks_are_taken_last_least_recently_freed_first_and_lose_their_hash():
    pool = BlockPool(3)
    first, second = full_block(pool, (1,)), full_block(pool, (2,))
    pool.decref(second)
    pool.decref(first)
    assert (pool.num_free, pool.num_cached_free) == (3, 2)
    assert pool.allocate() == 2  # the fresh block before any eviction
    assert pool.counters.evictions == 0
    assert pool.allocate() == second  # freed before `first`: least recently used
    assert pool.block_hash(second) is None
    assert pool.lookup(hash_block(None, (2,), None)) is None
    assert pool.counters.evictions == 1
    assert pool.lookup(hash_block(None, (1,), None)) == first
    pool.check_integrity()


def test_incref_takes_a_cached_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(5)
    blocks = [full_block(pool, (i,)) for i in range(5)]
    for block in blocks:
        pool.decref(block)
    pool.incref(blocks[2])
    assert pool.free_queue() == [0, 1, 3, 4]
    assert (pool.ref_count(2), pool.num_free, pool.num_cached_free) == (1, 4, 4)
    pool.check_integrity()


class CountingList(list):
    """A link list that counts how many links are read."""

    reads = 0

    def __getitem__(self, index):
        CountingList.reads += 1
        return super().__getitem__(index)


def test_cached_free_blocks_walks_only_the_cached_tail_of_the_queue():
    pool = BlockPool(1000)
    blocks = [pool.allocate() for _ in range(1000)]
    cached = blocks[:3]
    for i, block in enumerate(cached):
        assert pool.register_hash(block, hash_block(None, (i,), None))
    for block in [cached[1], *blocks[3:], cached[0], cached[2]]:   # 997 plain ones between
        pool.decref(block)
    assert pool.cached_free_blocks() == [cached[1], cached[0], cached[2]]  # next evicted first
    assert pool.cached_free_blocks() == [b for b in pool.free_queue() if pool.block_hash(b)]
    pool._prev = CountingList(pool._prev)
    CountingList.reads = 0
    pool.cached_free_blocks()
    assert CountingList.reads == 4    # the sentinel's tail link + one per cached block
    pool.incref(cached[0])            # a prefix hit takes one out of the middle
    assert pool.cached_free_blocks() == [cached[1], cached[2]]
    assert BlockPool(5).cached_free_blocks() == []


def test_ref_counts_and_shared_count_follow_incref_and_decref():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.incref(block)
    pool.incref(block)
    assert (pool.ref_count(block), pool.num_shared) == (3, 1)
    assert pool.decref(block) is False
    assert pool.decref(block) is False
    assert pool.num_shared == 0
    assert pool.decref(block) is True
    assert (pool.counters.blocks_allocated, pool.counters.blocks_freed) == (1, 1)
    pool.check_integrity()


def test_freeing_a_block_twice_raises_and_changes_nothing():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.decref(block)
    with pytest.raises(BlockStateError, match="freed twice"):
        pool.decref(block)
    assert pool.num_free == 2
    pool.check_integrity()


def test_invalid_block_ids_and_reviving_a_plain_free_block_raise():
    pool = BlockPool(2)
    for bad in (-1, 2, "0", None):
        with pytest.raises(BlockStateError, match="block id"):
            pool.ref_count(bad)
    block = pool.allocate()
    pool.decref(block)
    with pytest.raises(BlockStateError, match="not cached"):
        pool.incref(block)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_hashes_are_write_once_only_on_used_blocks_and_never_duplicated():
    pool = BlockPool(3)
    block, twin = pool.allocate(), pool.allocate()
    key = hash_block(None, (5, 6), None)
    assert pool.register_hash(block, key) is True
    with pytest.raises(BlockStateError, match="write-once"):
        pool.register_hash(block, hash_block(None, (7, 8), None))
    assert pool.register_hash(twin, key) is False  # same tokens stay in one cached block
    assert pool.block_hash(twin) is None
    with pytest.raises(BlockStateError, match="only a used block"):
        pool.register_hash(2, hash_block(None, (9,), None))
    pool.check_integrity()


def test_lookup_verifies_tokens_and_extra_key_not_just_the_hash_value():
    pool = BlockPool(1)
    real = hash_block(None, (1, 2), "model-a")
    block = pool.allocate()
    pool.register_hash(block, real)
    assert pool.lookup(hash_block(None, (1, 2), "model-a")) == block
    collision = BlockHash(real.value, (None, (3, 4), "model-a"))  # same value, other tokens
    assert pool.lookup(collision) is None
    assert pool.lookup(BlockHash(real.value, (None, (1, 2), "model-b"))) is None


def test_chained_hashes_depend_on_the_parent_and_reject_non_integer_tokens():
    tokens = [1, 2, 3, 4, 1, 2]
    first, second = iter_block_hashes(tokens, 2, 2, None)
    assert second.parent == first.value
    assert hash_block(None, (3, 4), None) != second
    assert hash_block(first.value, (3, 4), None) == second
    with pytest.raises(TypeError, match="token_ids must be integers"):
        hash_block(None, [1.5, 2], None)


def test_integrity_check_reports_corruption():
    pool = BlockPool(3)
    block = pool.allocate()
    pool._ref[block] = 0  # a used block that is neither queued nor fresh
    with pytest.raises(AssertionError, match="not in the free queue"):
        pool.check_integrity()


def test_a_million_block_pool_is_built_quickly_and_works_at_both_ends():
    start = time.perf_counter()
    pool = BlockPool(1_000_000)
    built = time.perf_counter() - start
    assert built < 2.0, f"building 1M blocks took {built:.2f} s"
    assert pool.allocate() == 0
    assert (pool.num_free, pool.num_used) == (999_999, 1)


def test_a_pool_rebuilt_from_reference_counts_holds_exactly_them():
    pool = BlockPool.holding([0, 2, 1, 0, 3])
    pool.check_integrity()
    assert [pool.ref_count(b) for b in range(5)] == [0, 2, 1, 0, 3]
    assert (pool.num_used, pool.num_free, pool.num_shared, pool.num_cached_free) == (3, 2, 2, 0)
    assert sorted([pool.allocate(), pool.allocate()]) == [0, 3]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
