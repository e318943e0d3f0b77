"""The AVX2 prefill attention kernel (kernels/cpu/prefill_attention_avx2.c: float32 FMAs on
widened K/V, 16 query rows per item) against float32 attention of the same bf16 inputs, and an
engine run with it against the gather + SDPA fallback. Runs on any x86 CPU with AVX2 and FMA
(its entry called directly where the AMX or AVX-512 kernel would be taken first)."""
from __future__ import annotations

import pytest
import torch

from pagedgen.kernels.cpu import native
from test_native_prefill_avx512 import (_case, _expected,
                                        assert_declines_what_no_vector_kernel_covers,
                                        assert_engine_matches_the_sdpa_fallback)

has_avx2 = native.load() is not None and bool(native.load().avx2_gemm_available())
pytestmark = pytest.mark.skipif(not has_avx2,
                                reason="no AVX2 and FMA on this CPU (or no C compiler)")


def _call_avx2(query, k_cache, v_cache, blocks, context_len, scale, out, threads=None,
               window=0) -> int:
    q_len, num_q_heads, head_dim = query.shape
    return native.load().prefill_attention_avx2_bf16(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        blocks.data_ptr(), context_len, q_len, out.data_ptr(), num_q_heads, k_cache.shape[2],
        head_dim, k_cache.shape[1], scale, window, threads or torch.get_num_threads())


def _assert_one_rounding_apart(got, expected):
    # float32 sums in another order (P not rounded), one rounding of the output to bf16.
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=2e-4)


@pytest.mark.parametrize("q_len,context_len", [(1, 1), (1, 37), (5, 5), (8, 8), (9, 50),
                                               (17, 17), (70, 70), (70, 600), (48, 311)])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 128, 32), (8, 2, 128, 8), (3, 1, 64, 32), (4, 1, 256, 16),
    (32, 8, 64, 16)])
def test_avx2_prefill_matches_float32_attention(q_len, context_len, q_heads, kv_heads, head_dim,
                                                block_size):
    query, k_cache, v_cache, blocks = _case(q_len, context_len, q_heads, kv_heads, head_dim,
                                            block_size, seed=q_len * 1000 + context_len)
    out = torch.full((q_len, q_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    assert _call_avx2(query, k_cache, v_cache, blocks, context_len, scale, out) == 0
    _assert_one_rounding_apart(out, _expected(query, k_cache, v_cache, blocks, context_len, scale))


@pytest.mark.parametrize("threads", [2, 5, 16])
@pytest.mark.parametrize("q_len,context_len,q_heads,kv_heads", [(1, 200, 9, 3), (20, 300, 12, 3),
                                                                (40, 90, 8, 2), (3, 3, 4, 4)])
def test_avx2_prefill_splits_groups_across_threads(threads, q_len, context_len, q_heads, kv_heads):
    # few row blocks for the threads: an item takes part of a kv head's group of query heads
    query, k_cache, v_cache, blocks = _case(q_len, context_len, q_heads, kv_heads, 64, 16,
                                            seed=threads + q_len)
    out = torch.full((q_len, q_heads, 64), float("nan"), dtype=torch.bfloat16)
    assert _call_avx2(query, k_cache, v_cache, blocks, context_len, 0.125, out, threads) == 0
    _assert_one_rounding_apart(out, _expected(query, k_cache, v_cache, blocks, context_len, 0.125))


@pytest.mark.parametrize("q_len,context_len,window", [
    (70, 70, 21), (40, 300, 37), (5, 260, 100), (33, 90, 8), (16, 512, 512)])
def test_avx2_prefill_sliding_window_matches_float32_attention(q_len, context_len, window):
    # windows that start mid-step: the first step's keys before a row's window are masked
    query, k_cache, v_cache, blocks = _case(q_len, context_len, 4, 1, 256, 16, seed=window)
    out = torch.full((q_len, 4, 256), float("nan"), dtype=torch.bfloat16)
    assert _call_avx2(query, k_cache, v_cache, blocks, context_len, 0.0625, out, 2, window) == 0
    _assert_one_rounding_apart(
        out, _expected(query, k_cache, v_cache, blocks, context_len, 0.0625, window))


def test_a_scale_above_one_and_rows_that_see_no_key_of_a_step_stay_finite():
    # scale 4: the score factor exceeds 1, and the first rows of a late item see none of its
    # last step's keys
    query, k_cache, v_cache, blocks = _case(12, 12, 2, 1, 64, 16, seed=3)
    out = torch.empty(12, 2, 64, dtype=torch.bfloat16)
    assert _call_avx2(query, k_cache, v_cache, blocks, 12, 4.0, out, 1) == 0
    assert torch.isfinite(out.float()).all()
    _assert_one_rounding_apart(out, _expected(query, k_cache, v_cache, blocks, 12, 4.0))


def test_avx2_prefill_declines_what_it_does_not_cover():
    assert_declines_what_no_vector_kernel_covers(_call_avx2)


def test_dispatch_names_the_kernel_where_it_runs():
    library = native.load()
    taken_first = library.prefill_attention_supported(9, 3, 64) or \
        library.prefill_attention_avx512_supported(9, 3, 64)
    if not taken_first:
        assert native.prefill_attention_path(9, 3, 64) == "AVX2"
    assert native.prefill_attention_path(4, 2, 32) == "torch sdpa"


def test_engine_greedy_outputs_match_the_sdpa_fallback(tmp_path, monkeypatch):
    # As the AVX-512 kernel's engine test; the AVX-512 entry declines too, so that this
    # kernel runs on any CPU that has AVX2.
    assert_engine_matches_the_sdpa_fallback(tmp_path, monkeypatch,
                                            "prefill_attention_avx2_bf16",
                                            switched_off=("prefill_attention_avx512_bf16",))
