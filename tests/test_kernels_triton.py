"""Triton kernels against the reference, on CPU tensors through TRITON_INTERPRET=1.

The interpreter is slow per operation, so shapes stay small: few heads, small head_dim,
few sequences. Lengths still cross block boundaries, query tiles and KV loop iterations.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pagedgen.kernels import reference  # noqa: E402

from pagedgen.kernels.triton import ops as triton_ops
from paged_batch import make_paged_batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SCALE = 0.3


def mixed_batch_lens(block_size: int) -> tuple[list[int], list[int]]:
    """(seq_lens, q_lens): decodes on/across block edges, a fresh prefill, prefill chunks
    after cached blocks (one long enough for several query tiles and KV iterations)."""
    b = block_size
    seq_lens = [1, b, b + 1, 3 * b - 1, b + 3, 2 * b + 5, 150, 140]
    q_lens = [1, 1, 1, 1, b + 3, 7, 1, 70]
    return seq_lens, q_lens


def assert_matches_reference(batch, out, atol=1e-5):
    expected = reference.paged_attention(batch.query.float(), batch.k_cache.float(),
                                         batch.v_cache.float(), *batch.attention_args()[3:],
                                         SCALE)
    assert out.dtype == batch.query.dtype
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_triton_attention_matches_reference(block_size, group):
    seq_lens, q_lens = mixed_batch_lens(block_size)
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=2 * group, num_kv_heads=2,
                             head_dim=16, block_size=block_size, seed=block_size * group)
    assert_matches_reference(batch, triton_ops.paged_attention(*batch.attention_args(), SCALE))


@pytest.mark.parametrize("head_dim", [24, 64, 128])  # 24: padded to 32 with masks
def test_triton_attention_head_dims(head_dim):
    batch = make_paged_batch([40, 9, 30], [1, 9, 5], num_q_heads=3, num_kv_heads=1,
                             head_dim=head_dim, block_size=16, seed=head_dim)
    assert_matches_reference(batch, triton_ops.paged_attention(*batch.attention_args(), SCALE))


def test_triton_attention_bfloat16():
    batch = make_paged_batch([33, 20], [1, 12], num_q_heads=6, num_kv_heads=2, head_dim=32,
                             block_size=8, dtype=torch.bfloat16, seed=3)
    out = triton_ops.paged_attention(*batch.attention_args(), SCALE)
    assert_matches_reference(batch, out, atol=2e-2)


def test_triton_attention_strided_query_and_plan():
    # The runner's Q is a view into a fused QKV projection: rows are not contiguous.
    batch = make_paged_batch([20, 17], [1, 17], num_q_heads=4, num_kv_heads=2, head_dim=16,
                             block_size=8, seed=5)
    fused = torch.randn(batch.query.shape[0], 8, 16)
    fused[:, 2:6] = batch.query
    q, *rest = batch.attention_args()
    plan = triton_ops.plan_attention(batch.block_tables, batch.seq_lens,
                                     batch.query_start_loc, 8)
    out = triton_ops.paged_attention(fused[:, 2:6], *rest, SCALE, plan=plan)
    assert_matches_reference(batch, out)


def test_triton_store_kv_skips_minus_one_and_reads_strided_keys():
    k_cache = torch.zeros(5, 8, 2, 4)
    v_cache = torch.zeros_like(k_cache)
    fused = torch.randn(20, 3, 2, 4)  # [T, q/k/v, H, D]: key and value are strided views
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.full((20,), -1, dtype=torch.int32)
    slots[[0, 3, 17, 19]] = torch.tensor([17, 3, 39, 8], dtype=torch.int32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    triton_ops.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert int((k_cache.abs().sum(dim=(2, 3)) > 0).sum()) == 4  # the -1 tokens went nowhere


def test_triton_copy_blocks_matches_reference():
    kv_cache = torch.randn(3, 2, 6, 8, 2, 16)
    expected = kv_cache.clone()
    src, dst = torch.tensor([1, 4, 2]), torch.tensor([5, 0, 3])
    reference.copy_blocks(expected, src, dst)
    triton_ops.copy_blocks(kv_cache, src, dst)
    assert torch.equal(kv_cache, expected)
    assert not torch.equal(expected[:, :, 5], kv_cache[:, :, 4])  # a copy really happened


def test_triton_rejects_bad_metadata():
    batch = make_paged_batch([5, 3], [5, 1], num_q_heads=2, num_kv_heads=1, head_dim=16,
                             block_size=8)
    q, k, v, tables, lens, starts = batch.attention_args()
    with pytest.raises(ValueError, match="query_start_loc"):
        triton_ops.paged_attention(q, k, v, tables, lens, starts[:2], SCALE)
    with pytest.raises(ValueError, match="query has 5 tokens"):
        triton_ops.paged_attention(q[:5], k, v, tables, lens, starts, SCALE)



def test_kernels_compile_for_hopper_without_a_gpu():
    # The interpreter lets through what the GPU compiler rejects (tl.dot shape limits, dtype
    # rules): compile every kernel to an sm_90 cubin, in a process without TRITON_INTERPRET.
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_check.py"),
                           "--quick"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "paged_attention_kernel" in done.stdout and "copy_blocks_kernel" in done.stdout


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_triton_sliding_window_matches_reference_and_skips_dropped_blocks(block_size, window):
    from window_cases import poison_dropped_blocks, window_batch_lens
    seq_lens, q_lens = window_batch_lens(block_size, window)
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=4, num_kv_heads=2, head_dim=16,
                             block_size=block_size, seed=window)
    expected = reference.paged_attention(*batch.attention_args(), SCALE, sliding_window=window)
    assert poison_dropped_blocks(batch, window) > 0
    plan = triton_ops.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                     block_size, window)
    out = triton_ops.paged_attention(*batch.attention_args(), SCALE, plan=plan,
                                     sliding_window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt_name", ["int8", "fp8_e4m3"])
def test_triton_sliding_window_on_8bit_pools(fmt_name):
    from test_kv_quant import dequantized, quantize_pool
    from window_cases import poison_dropped_blocks, window_batch_lens
    block_size, window = 8, 11
    seq_lens, q_lens = window_batch_lens(block_size, window)
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=4, num_kv_heads=2, head_dim=16,
                             block_size=block_size, seed=2)
    k, v, ks, vs = quantize_pool(batch.k_cache, batch.v_cache, fmt_name)
    expected = reference.paged_attention(batch.query, dequantized(k, ks), dequantized(v, vs),
                                         *batch.attention_args()[3:], SCALE,
                                         sliding_window=window)
    poison_dropped_blocks(batch, window, ks, vs)
    out = triton_ops.paged_attention(batch.query, k, v, *batch.attention_args()[3:], SCALE,
                                     k_scales=ks, v_scales=vs, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
