"""CPU kernels (cpu_backend) against the reference, and the reference against dense attention."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedgen.kernels import get_ops, reference
from pagedgen.kernels.cpu import backend as cpu_backend
from paged_batch import make_paged_batch

SCALE = 0.3


def mixed_batch_lens(block_size: int) -> tuple[list[int], list[int]]:
    """(seq_lens, q_lens): decodes on and across block edges, fresh prefills, a prefill
    chunk after cached blocks, one starting exactly on a block boundary."""
    b = block_size
    seq_lens = [1, b, b + 1, 3 * b - 1, b + 3, 2 * b + 5, 2 * b + 3, 1]
    q_lens = [1, 1, 1, 1, b + 3, 7, b + 3, 1]
    return seq_lens, q_lens


# --- the oracle itself ------------------------------------------------------------------

def dense_causal_attention(q_full, k, v, scale):
    """Plain causal attention of a whole contiguous sequence, one kv head group at a time."""
    num_kv_heads = k.shape[1]
    group = q_full.shape[1] // num_kv_heads
    outs = []
    for h in range(num_kv_heads):
        q_h = q_full[:, h * group:(h + 1) * group].transpose(0, 1)  # [group, L, D]
        k_h = k[:, h].expand(group, -1, -1)
        v_h = v[:, h].expand(group, -1, -1)
        outs.append(F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=True, scale=scale))
    return torch.cat(outs, dim=0).transpose(0, 1)  # [L, H_q, D]


@pytest.mark.parametrize("block_size,num_q_heads", [(8, 4), (16, 3), (8, 2)])
def test_reference_matches_dense_attention_on_contiguous_layout(block_size, num_q_heads):
    # Dense causal attention over the whole sequence, then keep the last q_len rows: an
    # independent way to get "queries at the end of the context" without an offset mask.
    gen = torch.Generator().manual_seed(1)
    seq_lens, q_lens = [13, 1, 21, 9], [13, 1, 4, 1]
    num_kv_heads, head_dim = 1, 16
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
    queries = [torch.randn(n, num_q_heads, head_dim, generator=gen) for n in seq_lens]
    k_cache, v_cache, tables = _write_paged(keys, values, block_size)
    query = torch.cat([q[-ql:] for q, ql in zip(queries, q_lens)])
    starts = torch.tensor([0, *q_lens]).cumsum(0).int()
    out = reference.paged_attention(query, k_cache, v_cache, tables,
                                    torch.tensor(seq_lens).int(), starts, SCALE)
    expected = torch.cat([dense_causal_attention(q, k, v, SCALE)[-ql:]
                          for q, k, v, ql in zip(queries, keys, values, q_lens)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _write_paged(keys, values, block_size):
    """Scatter contiguous per-sequence K/V into a cache, blocks in reverse order."""
    counts = [-(-k.shape[0] // block_size) for k in keys]
    num_blocks = sum(counts) + 1
    shape = (num_blocks, block_size, *keys[0].shape[1:])
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    tables = torch.zeros(len(keys), max(counts), dtype=torch.int32)
    next_block = num_blocks - 1
    for s, (k, v) in enumerate(zip(keys, values)):
        for i in range(k.shape[0]):
            if i % block_size == 0:
                tables[s, i // block_size] = next_block
                next_block -= 1
            k_cache[tables[s, i // block_size], i % block_size] = k[i]
            v_cache[tables[s, i // block_size], i % block_size] = v[i]
    return k_cache, v_cache, tables


# --- cpu_backend vs reference ---------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_torch_attention_matches_reference(block_size, group):
    seq_lens, q_lens = mixed_batch_lens(block_size)
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=2 * group, num_kv_heads=2,
                             head_dim=32, block_size=block_size, seed=block_size + group)
    out = cpu_backend.paged_attention(*batch.attention_args(), SCALE)
    expected = reference.paged_attention(*batch.attention_args(), SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_plan_is_reusable_across_layers():
    seq_lens, q_lens = mixed_batch_lens(16)
    first = make_paged_batch(seq_lens, q_lens, num_q_heads=6, num_kv_heads=2, head_dim=16,
                             block_size=16)
    plan = cpu_backend.plan_attention(first.block_tables, first.seq_lens, first.query_start_loc, 16)
    for layer in range(3):  # same metadata, fresh Q/K/V per layer, as in the runner
        batch = replace(first, query=torch.randn_like(first.query),
                        k_cache=torch.randn_like(first.k_cache),
                        v_cache=torch.randn_like(first.v_cache))
        out = cpu_backend.paged_attention(*batch.attention_args(), SCALE, plan=plan)
        expected = reference.paged_attention(*batch.attention_args(), SCALE)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
def test_torch_attention_bfloat16_close_to_float32_reference(group):
    seq_lens, q_lens = mixed_batch_lens(16)
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=3 * group, num_kv_heads=3,
                             head_dim=64, block_size=16, dtype=torch.bfloat16, seed=7)
    out = cpu_backend.paged_attention(*batch.attention_args(), 64 ** -0.5)
    assert out.dtype == torch.bfloat16
    # The oracle sees the same bf16 inputs, computed in float32.
    expected = reference.paged_attention(batch.query.float(), batch.k_cache.float(),
                                         batch.v_cache.float(), *batch.attention_args()[3:],
                                         64 ** -0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([8, 16]), group=st.sampled_from([1, 2, 3]))
def test_torch_attention_random_batches(data, block_size, group):
    num_seqs = data.draw(st.integers(1, 5))
    seq_lens = data.draw(st.lists(st.integers(1, 50), min_size=num_seqs, max_size=num_seqs))
    q_lens = [data.draw(st.integers(1, n)) for n in seq_lens]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=2 * group, num_kv_heads=2,
                             head_dim=8, block_size=block_size, seed=sum(seq_lens))
    out = cpu_backend.paged_attention(*batch.attention_args(), SCALE)
    expected = reference.paged_attention(*batch.attention_args(), SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# --- store_kv and copy_blocks -------------------------------------------------------------

@pytest.mark.parametrize("ops", [reference, cpu_backend], ids=["reference", "cpu_backend"])
def test_store_kv_writes_slots_and_skips_minus_one(ops):
    block_size, num_blocks = 8, 5
    k_cache = torch.zeros(num_blocks, block_size, 2, 4)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(4, 2, 4), torch.randn(4, 2, 4)
    slots = torch.tensor([17, -1, 3, 39])  # block 2 off 1, skipped, block 0 off 3, block 4 off 7
    ops.store_kv(key, value, k_cache, v_cache, slots)
    for t, (block, offset) in {0: (2, 1), 2: (0, 3), 3: (4, 7)}.items():
        assert torch.equal(k_cache[block, offset], key[t])
        assert torch.equal(v_cache[block, offset], value[t])
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    written[[2, 0, 4], [1, 3, 7]] = True
    assert not k_cache[~written].any() and not v_cache[~written].any()  # token 1 went nowhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_from_strided_qkv_views_matches_reference(dtype):
    # The model passes K as a slice of the rotated q|k and V as one of the fused QKV output:
    # strided rows, each with its own stride.
    qkv, rotated_qk = torch.randn(6, 3 + 2 + 2, 16).to(dtype), torch.randn(6, 3 + 2, 16).to(dtype)
    key, value = rotated_qk[:, 3:], qkv[:, 5:7]
    slots = torch.tensor([5, 0, -1, 31, 12, 8])
    expected_k = torch.zeros(4, 8, 2, 16, dtype=dtype)
    expected_v = torch.zeros_like(expected_k)
    reference.store_kv(key, value, expected_k, expected_v, slots)
    got_k, got_v = torch.zeros_like(expected_k), torch.zeros_like(expected_v)
    cpu_backend.store_kv(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)


def test_store_kv_slot_past_the_cache_raises_and_writes_nothing():
    k_cache, v_cache = torch.zeros(2, 8, 1, 4), torch.zeros(2, 8, 1, 4)
    key = torch.ones(2, 1, 4)
    with pytest.raises((ValueError, IndexError, RuntimeError)):
        cpu_backend.store_kv(key, key, k_cache, v_cache, torch.tensor([3, 16]))
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("ops", [reference, cpu_backend], ids=["reference", "cpu_backend"])
def test_copy_blocks_copies_every_layer_k_and_v(ops):
    kv_cache = torch.randn(3, 2, 6, 4, 2, 8)
    before = kv_cache.clone()
    ops.copy_blocks(kv_cache, torch.tensor([1, 4]), torch.tensor([5, 0]))
    assert torch.equal(kv_cache[:, :, 5], before[:, :, 1])
    assert torch.equal(kv_cache[:, :, 0], before[:, :, 4])
    untouched = [1, 2, 3, 4]
    assert torch.equal(kv_cache[:, :, untouched], before[:, :, untouched])


def test_store_then_attend_sees_new_tokens():
    # The runner's order: store this step's K/V, then attend; the new token must be visible.
    batch = make_paged_batch([9], [1], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=8)
    new_k, new_v = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    slot = batch.block_tables[0, 1].long() * 8 + 0  # token 8 -> block table[1], offset 0
    cpu_backend.store_kv(new_k, new_v, batch.k_cache, batch.v_cache, slot.view(1))
    out = cpu_backend.paged_attention(*batch.attention_args(), SCALE)
    expected = reference.paged_attention(*batch.attention_args(), SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(batch.k_cache[batch.block_tables[0, 1], 0], new_k[0])


# --- bad input and dispatch ----------------------------------------------------------------

def test_bad_inputs_name_the_argument():
    batch = make_paged_batch([5, 3], [5, 1], num_q_heads=4, num_kv_heads=2, head_dim=8,
                             block_size=8)
    q, k, v, tables, lens, starts = batch.attention_args()
    with pytest.raises(ValueError, match="query heads"):
        cpu_backend.paged_attention(q[:, :3], k, v, tables, lens, starts, SCALE)
    with pytest.raises(ValueError, match="seq_lens"):
        cpu_backend.paged_attention(q, k, v, tables, lens[:1], starts, SCALE)
    with pytest.raises(ValueError, match="seq_lens must be >="):
        cpu_backend.paged_attention(q, k, v, tables, torch.tensor([2, 3]).int(), starts, SCALE)
    with pytest.raises(ValueError, match="block_tables capacity"):
        cpu_backend.paged_attention(q, k, v, tables, torch.tensor([5, 99]).int(), starts, SCALE)
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_backend.store_kv(k[0], v[0], k, v, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="src and dst"):
        cpu_backend.copy_blocks(torch.zeros(1, 2, 3, 8, 2, 8), torch.tensor([0]),
                              torch.tensor([1, 2]))


def test_get_ops_cpu_is_cpu_backend():
    assert get_ops("cpu") is cpu_backend
    assert get_ops(torch.device("cpu")) is cpu_backend
