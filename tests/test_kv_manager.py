"""KVCacheManager: each rule of docs/contracts.md section 3 with exact block counts (B = 16)."""

import dataclasses

import pytest

from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.engine.kv_types import (
    BlockStateError, DuplicateSequenceError, KVCounters, NoFreeBlocksError, PoolSnapshot, UnknownSequenceError,
)

B = 16


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def run_prompt(kv: KVCacheManager, seq_id: int, tokens: list[int]) -> int:
    """Admit and compute the rest of the prompt, as the scheduler would in one step."""
    hit = kv.admit(seq_id, tokens)
    kv.append_slots(seq_id, tokens[hit:])
    return hit


def state(kv: KVCacheManager) -> tuple:
    return (kv.snapshot(), kv.block_tables(), dataclasses.astuple(kv.counters), kv.free_queue())


# --- demand paging, fork, copy-on-write ---------------------------------------------------------

def test_32_token_prompt_fork_and_append_at_a_block_boundary():
    kv = KVCacheManager(num_blocks=8, block_size=B)
    run_prompt(kv, 1, prompt(32))
    assert kv.block_table(1) == [0, 1]
    kv.fork(1, 2)
    assert kv.counters.blocks_allocated == 2  # the fork allocated nothing
    assert [kv.ref_count(b) for b in (0, 1)] == [2, 2]
    kv.append_slots(1, [99])  # token index 32 starts a block
    assert kv.counters.blocks_allocated == 3
    assert kv.block_table(1) == [0, 1, 2]
    assert kv.block_table(2) == [0, 1]
    assert kv.take_pending_copies() == []
    kv.check_integrity()


def test_40_token_prompt_forked_four_ways_copies_only_the_partial_block_three_times():
    kv = KVCacheManager(num_blocks=16, block_size=B)
    run_prompt(kv, 0, prompt(40))
    for child in (1, 2, 3):
        kv.fork(0, child)
    before = kv.counters.blocks_allocated
    for seq in (0, 1, 2, 3):
        kv.append_slots(seq, [7])
    assert kv.counters.cow_copies == 3
    assert kv.counters.blocks_allocated - before == 3
    assert [kv.ref_count(b) for b in (0, 1)] == [4, 4]  # full blocks stay shared
    assert kv.take_pending_copies() == [(2, 3), (2, 4), (2, 5)]
    assert kv.block_table(3) == [0, 1, 2]  # the last holder writes in place
    assert kv.take_pending_copies() == []
    assert kv.snapshot().tokens_stored == 32 + 4 * 9
    kv.check_integrity()


def test_demand_paging_allocates_only_at_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=B, enable_prefix_caching=False)
    kv.admit(0, [1])
    for t in range(50):
        assert kv.blocks_to_append(0, 1) == (1 if t % B == 0 else 0)
        kv.append_slots(0, [t])
        assert len(kv.block_table(0)) == -(-(t + 1) // B)
        assert kv.num_tokens(0) == t + 1
    assert kv.counters.blocks_allocated == 4
    assert kv.snapshot().tokens_stored == 50


def test_shared_blocks_return_to_the_pool_only_with_their_last_reference():
    kv = KVCacheManager(num_blocks=8, block_size=B, enable_prefix_caching=False)
    run_prompt(kv, 0, prompt(20))
    kv.fork(0, 1)
    assert kv.blocks_freed_by([0]) == 0
    assert kv.blocks_freed_by([0, 1]) == 2
    kv.free(0)
    assert (kv.snapshot().blocks_used, kv.counters.blocks_freed) == (2, 0)
    assert [kv.ref_count(b) for b in kv.block_table(1)] == [1, 1]
    kv.append_slots(1, [5])  # sole holder now: in place, no copy
    assert kv.counters.cow_copies == 0
    kv.free(1)
    assert (kv.snapshot().blocks_used, kv.counters.blocks_freed) == (0, 2)
    kv.check_integrity()


def test_copy_on_write_when_the_write_fills_and_overflows_the_shared_block():
    kv = KVCacheManager(num_blocks=8, block_size=B)
    run_prompt(kv, 0, prompt(10))
    kv.fork(0, 1)
    assert kv.blocks_to_append(1, 20) == 2  # one copy, one block for tokens 16..29
    kv.append_slots(1, prompt(20, start=10))
    assert kv.take_pending_copies() == [(0, 1)]
    assert kv.block_table(1) == [1, 2]
    assert kv.is_cached(1) and not kv.is_cached(0)  # the copy filled up, got hashed
    kv.check_integrity()


def test_slot_maps_token_index_through_the_block_table():
    kv = KVCacheManager(num_blocks=8, block_size=B)
    run_prompt(kv, 0, prompt(20))
    kv.fork(0, 1)
    kv.append_slots(1, [3])  # copy-on-write moves token 16..20 of seq 1 into block 2
    assert [kv.slot(0, i) for i in (0, 15, 16, 19)] == [0, 15, 16, 19]
    assert [kv.slot(1, i) for i in (15, 16, 20)] == [15, 2 * B, 2 * B + 4]
    with pytest.raises(IndexError, match="token_index"):
        kv.slot(0, 20)


# --- prefix caching ------------------------------------------------------------------------------

def test_prefix_hit_reuses_verified_full_blocks_capped_before_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=B)
    run_prompt(kv, 0, prompt(48))
    kv.free(0)
    assert kv.num_cached_prefix_tokens(prompt(48)) == 32  # the last token is always computed
    assert kv.num_cached_prefix_tokens(prompt(49)) == 48
    assert kv.num_cached_prefix_tokens(prompt(47)) == 32
    assert kv.num_cached_prefix_tokens(prompt(17)) == 16
    assert kv.num_cached_prefix_tokens(prompt(16)) == 0
    other = prompt(49)
    other[20] = -1  # second block differs: only the first one is served
    assert kv.num_cached_prefix_tokens(other) == 16
    assert kv.num_cached_prefix_tokens(prompt(49, start=1)) == 0
    assert kv.admit(1, prompt(49)) == 48
    assert kv.block_table(1) == [0, 1, 2] and kv.num_tokens(1) == 48
    assert (kv.counters.prefix_query_tokens, kv.counters.prefix_hit_tokens) == (48 + 49, 48)
    snap = kv.snapshot()
    assert (snap.blocks_used, snap.blocks_cached_free, snap.tokens_stored) == (3, 0, 48)
    kv.append_slots(1, [48])
    assert kv.block_table(1) == [0, 1, 2, 3]
    kv.check_integrity()


def test_prefix_hits_are_registered_as_soon_as_blocks_fill_so_the_same_step_can_hit():
    kv = KVCacheManager(num_blocks=16, block_size=B)
    kv.admit(0, prompt(40))
    kv.append_slots(0, prompt(20))  # a first prefill chunk fills one block
    assert kv.num_cached_prefix_tokens(prompt(40)) == 16
    assert kv.admit(1, prompt(40)) == 16
    assert kv.ref_count(0) == 2
    assert kv.snapshot().blocks_shared == 1


def test_extra_key_separates_models_sharing_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=B, hash_extra_key="model-a")
    run_prompt(kv, 0, prompt(33))
    assert kv.num_cached_prefix_tokens(prompt(33)) == 32
    kv.hash_extra_key = "model-b"
    assert kv.num_cached_prefix_tokens(prompt(33)) == 0
    with pytest.raises(TypeError, match="hash_extra_key"):
        KVCacheManager(num_blocks=8, block_size=B, hash_extra_key=["unhashable"])


def test_hit_on_a_block_in_use_shares_it_and_costs_no_free_block():
    kv = KVCacheManager(num_blocks=4, block_size=B)
    run_prompt(kv, 0, prompt(33))  # 3 blocks used, 1 free
    assert kv.can_admit(prompt(33), 1)  # 2 shared hits + 1 new block
    assert not kv.can_admit(prompt(33), 17)  # 2 new blocks needed
    assert kv.admit(1, prompt(33)) == 32
    assert kv.snapshot().blocks_free == 1
    kv.append_slots(1, [32])
    assert kv.snapshot().blocks_free == 0


def test_hit_on_a_cached_free_block_consumes_a_free_block():
    kv = KVCacheManager(num_blocks=4, block_size=B)
    run_prompt(kv, 0, prompt(32))
    kv.free(0)
    run_prompt(kv, 9, prompt(5, start=700))
    snap = kv.snapshot()
    assert (snap.blocks_free, snap.blocks_cached_free) == (3, 2)
    assert kv.can_admit(prompt(33), 1)  # 2 revived + 1 new = 3
    assert not kv.can_admit(prompt(33), 17)  # 2 revived + 2 new > 3 (it would fit 4 blocks)
    run_prompt(kv, 1, prompt(33))
    assert kv.snapshot().blocks_free == 0
    kv.check_integrity()


def test_eviction_is_lazy_lru_and_takes_a_chains_tail_before_its_head():
    kv = KVCacheManager(num_blocks=6, block_size=B)
    run_prompt(kv, 0, prompt(48, start=0))  # chain A: blocks 0, 1, 2
    run_prompt(kv, 1, prompt(48, start=100))  # chain B: blocks 3, 4, 5
    kv.free(0)
    kv.free(1)
    assert kv.snapshot().blocks_cached_free == 6  # freed, still reusable
    assert kv.free_queue() == [2, 1, 0, 5, 4, 3]
    run_prompt(kv, 2, prompt(17, start=500))  # needs 2 blocks: evicts A's tail, then its middle
    assert kv.block_table(2) == [2, 1]
    assert kv.counters.evictions == 2
    assert kv.num_cached_prefix_tokens(prompt(49, start=0)) == 16
    assert kv.num_cached_prefix_tokens(prompt(49, start=100)) == 48
    kv.check_integrity()


def test_a_prefix_hit_makes_cached_blocks_most_recently_used_again():
    kv = KVCacheManager(num_blocks=4, block_size=B)
    run_prompt(kv, 0, prompt(32, start=0))  # A: blocks 0, 1
    run_prompt(kv, 1, prompt(32, start=100))  # B: blocks 2, 3
    kv.free(0)
    kv.free(1)
    assert kv.admit(2, prompt(17, start=0)) == 16  # revives A's head only
    kv.free(2)
    assert kv.free_queue() == [1, 3, 2, 0]
    run_prompt(kv, 3, prompt(33, start=900))  # 3 blocks: A's tail, then B's tail and head
    assert kv.block_table(3) == [1, 3, 2]
    assert kv.num_cached_prefix_tokens(prompt(17, start=0)) == 16
    kv.check_integrity()


def test_identical_blocks_filled_at_once_are_cached_once():
    kv = KVCacheManager(num_blocks=8, block_size=B)
    assert kv.admit(0, prompt(33)) == 0
    assert kv.admit(1, prompt(33)) == 0  # nothing cached yet: both compute the prompt
    kv.append_slots(0, prompt(33))
    kv.append_slots(1, prompt(33))
    assert [kv.is_cached(b) for b in kv.block_table(0)] == [True, True, False]
    assert [kv.is_cached(b) for b in kv.block_table(1)] == [False, False, False]
    kv.free(1)
    assert kv.snapshot().blocks_cached_free == 0  # the duplicates went to the plain pool
    assert kv.free_queue() == [3, 4, 5]
    kv.free(0)
    assert kv.snapshot().blocks_cached_free == 2
    assert kv.admit(2, prompt(33)) == 32
    kv.check_integrity()


def test_prefix_caching_off_hashes_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=B, enable_prefix_caching=False)
    run_prompt(kv, 0, prompt(48))
    assert not any(kv.is_cached(b) for b in kv.block_table(0))
    kv.free(0)
    assert kv.num_cached_prefix_tokens(prompt(49)) == 0
    assert kv.admit(1, prompt(49)) == 0
    assert kv.snapshot().blocks_cached_free == 0
    assert (kv.counters.prefix_query_tokens, kv.counters.prefix_hit_tokens) == (0, 0)
    kv.check_integrity()


# --- capacity questions agree with the mutations --------------------------------------------------

def test_capacity_questions_match_what_the_mutations_then_do():
    kv = KVCacheManager(num_blocks=10, block_size=B)
    run_prompt(kv, 0, prompt(40))
    kv.fork(0, 1)
    kv.fork(0, 2)
    assert kv.blocks_to_append(1, 30) == 1 + 2  # copy + blocks for tokens 48..69
    before = kv.counters.blocks_allocated
    kv.append_slots(1, prompt(30))
    assert kv.counters.blocks_allocated - before == 3
    free = kv.snapshot().blocks_free  # 10 - 3 - 3 = 4
    assert free == 4
    # seq 0 and 2 share block 2 (ref 2): both writing costs one copy, not two.
    assert kv.can_append([0, 2], [8, 25])  # 1 copy + 0 + 2 new blocks = 3 <= 4
    assert kv.can_append([0, 2], [30, 8])  # 1 copy + 2 + 0 = 3
    assert not kv.can_append([0, 2], [30, 30])  # 1 copy + 2 + 2 = 5 > 4
    assert kv.can_append([1, 0], [10, 0])  # seq 1 has room in its last block; 0 writes nothing
    freed = kv.blocks_freed_by([1, 2])
    before_freed = kv.counters.blocks_freed
    kv.free(1)
    kv.free(2)
    assert kv.counters.blocks_freed - before_freed == freed == 3
    kv.check_integrity()


@pytest.mark.parametrize("extra", [0, 4, 5, 6, 7])
def test_can_append_for_a_group_is_exactly_the_point_where_appending_fails(extra):
    kv = KVCacheManager(num_blocks=10, block_size=B)
    run_prompt(kv, 0, prompt(40))  # 3 blocks
    kv.fork(0, 1)
    kv.fork(0, 2)  # block 2 shared by three; 7 free
    sizes = [8 + 16 * extra, 8, 8]  # seq 0 needs `extra` new blocks beyond its copy
    expected = kv.can_append([0, 1, 2], sizes)
    try:
        for seq, size in zip((0, 1, 2), sizes):
            kv.append_slots(seq, prompt(size))
        succeeded = True
    except NoFreeBlocksError:
        succeeded = False
    assert expected == succeeded == (2 + extra <= 7)
    kv.check_integrity()


def test_can_admit_and_admit_agree_on_a_pool_smaller_than_the_request():
    kv = KVCacheManager(num_blocks=2, block_size=B)
    assert kv.can_admit(prompt(32), 32)
    assert not kv.can_admit(prompt(33), 16)  # the whole prompt can never fit
    with pytest.raises(NoFreeBlocksError, match="needs 3 KV blocks .* only 2 blocks") as info:
        kv.admit(0, prompt(33))
    assert (info.value.needed, info.value.total) == (3, 2)
    assert kv.block_tables() == {}
    kv.admit(0, prompt(32))
    with pytest.raises(NoFreeBlocksError, match="needs 3 free KV blocks but only 2 of 2"):
        kv.append_slots(0, prompt(33))


# --- errors and atomicity --------------------------------------------------------------------------

def test_failed_append_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=B)
    run_prompt(kv, 0, prompt(40))
    kv.fork(0, 1)
    before = state(kv)
    with pytest.raises(NoFreeBlocksError):
        kv.append_slots(1, prompt(30))  # copy + 1 block > 1 free
    with pytest.raises(TypeError, match="token_ids must be integers"):
        kv.append_slots(1, [1.5] * 8)  # bad tokens are found before anything moves
    assert state(kv) == before
    assert kv.take_pending_copies() == []
    kv.check_integrity()


def test_unknown_and_duplicate_sequence_ids_raise():
    kv = KVCacheManager(num_blocks=4, block_size=B)
    run_prompt(kv, 0, prompt(5))
    with pytest.raises(DuplicateSequenceError, match="seq_id 0"):
        kv.admit(0, prompt(5))
    with pytest.raises(DuplicateSequenceError, match="child_id 0"):
        kv.fork(0, 0)
    with pytest.raises(UnknownSequenceError, match="unknown sequence id 7"):
        kv.fork(7, 8)
    kv.free(0)
    for call in (lambda: kv.append_slots(0, [1]), lambda: kv.free(0), lambda: kv.num_tokens(0),
                 lambda: kv.block_table(0), lambda: kv.blocks_to_append(0, 1),
                 lambda: kv.can_append([0], 1), lambda: kv.blocks_freed_by([0])):
        with pytest.raises(UnknownSequenceError, match="already freed"):
            call()
    with pytest.raises(TypeError, match="seq_id must be an int"):
        kv.admit("a", [1])
    kv.check_integrity()


def test_bad_arguments_name_the_argument():
    for kwargs, name in (({"num_blocks": 0, "block_size": 16}, "num_blocks"),
                         ({"num_blocks": 4, "block_size": 0}, "block_size"),
                         ({"num_blocks": 4.0, "block_size": 16}, "num_blocks")):
        with pytest.raises(ValueError, match=name):
            KVCacheManager(**kwargs)
    kv = KVCacheManager(num_blocks=4, block_size=B)
    run_prompt(kv, 0, prompt(5))
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
        kv.blocks_to_append(0, -1)
    with pytest.raises(ValueError, match="num_tokens has 1 entries for 2 seq_ids"):
        kv.can_append([0, 1], [1])
    with pytest.raises(ValueError, match="must not repeat"):
        kv.can_append([0, 0], 1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.can_admit([1], -3)
    with pytest.raises(BlockStateError, match="block id"):
        kv.ref_count(4)


# --- snapshot, counters, integrity -----------------------------------------------------------------

def test_snapshot_counts_every_field():
    kv = KVCacheManager(num_blocks=10, block_size=B)
    run_prompt(kv, 0, prompt(40))  # blocks 0, 1 (full, hashed) + 2 (8 tokens)
    kv.fork(0, 1)
    run_prompt(kv, 2, prompt(20, start=500))  # blocks 3 (full) + 4 (4 tokens)
    kv.free(2)  # 3 stays cached, 4 goes plain
    assert kv.snapshot() == PoolSnapshot(
        num_blocks=10, blocks_used=3, blocks_free=7, blocks_cached_free=1, blocks_shared=3,
        logical_blocks=6, tokens_stored=40)
    assert kv.counters == KVCounters(
        blocks_allocated=5, blocks_freed=2, cow_copies=0, prefix_query_tokens=60,
        prefix_hit_tokens=0, evictions=0)


def test_integrity_check_catches_a_corrupted_table():
    kv = KVCacheManager(num_blocks=4, block_size=B)
    run_prompt(kv, 0, prompt(20))
    kv._seqs[0].table[1] = 3  # points at a free block
    with pytest.raises(AssertionError, match="ref count"):
        kv.check_integrity()


# --- abort (after an error or Ctrl-C mid-step) -------------------------------------------------

def test_abort_recounts_the_pool_from_the_kept_tables_even_after_a_cut_update():
    kv = KVCacheManager(num_blocks=32, block_size=B, group_windows=(0, 32))
    run_prompt(kv, 0, prompt(40))          # a finished tree node, kept
    kv.fork(0, 1)                          # a branch sharing its blocks
    kv.append_slots(1, [7] * 30)
    run_prompt(kv, 2, prompt(20, start=500))
    kept_tables = kv.group_block_tables(0)
    kv._pool.decref(kv.block_table(2)[0])  # an update cut midway: a count no table agrees with
    kv.abort(keep={0, 99})                 # (99: a node the cut step had already dropped)
    kv.check_integrity()
    assert kv.block_tables().keys() == {0} and kv.group_block_tables(0) == kept_tables
    held = {b for table in kept_tables for b in table if b >= 0}
    assert kv.snapshot().blocks_used == len(held)
    # No hash survives: the cut step may have hashed blocks its forward never wrote.
    assert not any(kv.is_cached(b) for b in range(kv.num_blocks))
    assert kv.admit(3, prompt(40)) == 0
    kv.append_slots(3, prompt(40))         # the pool hands out the blocks the abort freed
    kv.check_integrity()
