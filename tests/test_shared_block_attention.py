"""Decode attention over sequences that begin with the same physical blocks (parallel samples,
requests behind one cached system prompt): the bf16 kernel reads those blocks once for all of
them and scores their keys 16 queries at a time. What a user relies on: each sequence gets what
it gets when attended alone (up to one bf16 rounding: the shared keys' dot products are summed
in another order), whatever its neighbours share, and the reference's values; with sharing off
(batch-invariant runs) exactly what it gets alone. On AMX CPUs units run on the tile unit or on
vector passes; both are tested."""
import pytest
import torch

from pagedgen.kernels import reference
from pagedgen.kernels.cpu import native

needs_native = pytest.mark.skipif(native.load() is None, reason="no C compiler here")

BLOCK = 16


def _shared_batch(groups, q_heads, kv_heads, head_dim, block_size=BLOCK, seed=0):
    """groups: (members, shared blocks, own lengths per member); a member's own length may be 0
    (its context ends with the shared blocks) or negative (it ends that many tokens before the
    end of the shared blocks, so it shares fewer whole blocks than its neighbours)."""
    gen = torch.Generator().manual_seed(seed)
    rows, lens, next_block = [], [], 0
    for members, shared_blocks, own in groups:
        shared = list(range(next_block, next_block + shared_blocks))
        next_block += shared_blocks
        for m in range(members):
            length = shared_blocks * block_size + own[m]
            own_blocks = max(0, -(-length // block_size) - shared_blocks)
            rows.append(shared + list(range(next_block, next_block + own_blocks)))
            next_block += own_blocks
            lens.append(length)
    width = max(len(row) for row in rows)
    order = torch.randperm(next_block + 2, generator=gen)  # scattered, as a used pool's
    tables = torch.tensor([[int(order[b]) for b in row] + [0] * (width - len(row))
                           for row in rows], dtype=torch.int64)
    num_blocks = next_block + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    query = torch.randn(len(rows), q_heads, head_dim, generator=gen).to(torch.bfloat16)
    return query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int64)


def _attend(query, k_cache, v_cache, tables, lens, scale):
    out = torch.full_like(query, float("nan"))
    assert native.decode_attention(query, k_cache, v_cache, tables, lens, scale, out)
    return out


def assert_same_but_rounding(got, alone):
    """Equal, or one bf16 rounding apart (2^-8 relative) where the float32 sums differ."""
    got, alone = got.float(), alone.float()
    assert ((got - alone).abs() <= alone.abs() * 2.0 ** -7 + 1e-6).all()
    assert (got != alone).float().mean() < 0.01


def _alone(query, k_cache, v_cache, tables, lens, scale):
    return torch.cat([_attend(query[i:i + 1], k_cache, v_cache, tables[i:i + 1].contiguous(),
                              lens[i:i + 1], scale) for i in range(len(lens))])


GROUPS = [
    (8, 5, [3, 17, 1, 40, 16, 9, 2, 30]),        # parallel samples of one prompt
    (5, 2, [0, 7, 0, 33, 5]),                     # some end with the shared blocks
    (1, 3, [11]),                                 # alone
    (4, 6, [-5, 20, -21, 4]),                     # some share fewer whole blocks
    (40, 4, [i % 23 for i in range(40)]),         # more than one unit holds
    (2, 1, [1, 2]),
    (3, 19, [5, 0, 12]),                          # past one pass of the tile sums (256 keys)
]


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 64), (4, 1, 256),
                                                       (8, 2, 128)])
def test_shared_blocks_give_each_sequence_what_it_gets_alone(threads, q_heads, kv_heads,
                                                                     head_dim, each_unit_form):
    query, k_cache, v_cache, tables, lens = _shared_batch(GROUPS, q_heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = _attend(query, k_cache, v_cache, tables, lens, scale)
        alone = _alone(query, k_cache, v_cache, tables, lens, scale)
    finally:
        torch.set_num_threads(before)
    assert_same_but_rounding(together, alone)
    expected = reference.paged_attention(query, k_cache, v_cache, tables.int(), lens.int(),
                                         torch.arange(len(lens) + 1, dtype=torch.int32), scale)
    torch.testing.assert_close(together.float(), expected.float(), atol=2e-2, rtol=2e-2)


@needs_native
@pytest.mark.parametrize("block_size,q_heads,kv_heads,head_dim", [(32, 9, 3, 64), (64, 32, 8, 64),
                                                                  (32, 8, 2, 128)])
def test_larger_blocks_give_each_sequence_what_it_gets_alone(block_size, q_heads, kv_heads,
                                                             head_dim, each_unit_form):
    # Blocks of two to four 16-key chunks; 9 shared blocks run past one pass of the tile sums.
    groups = [(6, 3, [5, 40, 0, 17, 70, 1]), (3, 9, [2, 33, 64])]
    query, k_cache, v_cache, tables, lens = _shared_batch(groups, q_heads, kv_heads, head_dim,
                                                          block_size=block_size, seed=5)
    scale = head_dim ** -0.5
    together = _attend(query, k_cache, v_cache, tables, lens, scale)
    assert_same_but_rounding(together, _alone(query, k_cache, v_cache, tables, lens, scale))
    expected = reference.paged_attention(query, k_cache, v_cache, tables.int(), lens.int(),
                                         torch.arange(len(lens) + 1, dtype=torch.int32), scale)
    torch.testing.assert_close(together.float(), expected.float(), atol=2e-2, rtol=2e-2)


@needs_native
def test_sharing_off_attends_every_row_alone_for_batch_invariance(each_unit_form):
    query, k_cache, v_cache, tables, lens = _shared_batch(GROUPS, 9, 3, 64, seed=3)
    off = torch.full_like(query, float("nan"))
    assert native.decode_attention(query, k_cache, v_cache, tables, lens, 0.125, off,
                                   share_blocks=False)
    assert torch.equal(off, _alone(query, k_cache, v_cache, tables, lens, 0.125))
    assert_same_but_rounding(_attend(query, k_cache, v_cache, tables, lens, 0.125), off)


@needs_native
def test_neighbours_that_share_nothing_and_a_sliding_window_are_attended_alone():
    # Same blocks at the same place but a window: each query sees its own last W keys only.
    query, k_cache, v_cache, tables, lens = _shared_batch([(6, 4, [5, 9, 0, 14, 2, 7])], 9, 3, 64)
    out = torch.full_like(query, float("nan"))
    assert native.decode_attention(query, k_cache, v_cache, tables, lens, 0.125, out,
                                   sliding_window=20)
    alone = torch.cat([
        _window_alone(query[i:i + 1], k_cache, v_cache, tables[i:i + 1].contiguous(),
                      lens[i:i + 1]) for i in range(len(lens))])
    assert torch.equal(out, alone)


def _window_alone(query, k_cache, v_cache, tables, lens):
    out = torch.full_like(query, float("nan"))
    assert native.decode_attention(query, k_cache, v_cache, tables, lens, 0.125, out,
                                   sliding_window=20)
    return out
