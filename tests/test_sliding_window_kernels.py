"""Sliding-window attention (a query at p sees keys in (p - W, p]) in the reference and the
torch paths of the CPU backend and the batch-invariant ops, against a dense band-masked
oracle; blocks wholly before the window are poisoned with NaN to prove they are never read."""
from __future__ import annotations

import pytest
import torch

from pagedgen.kernels import reference
from pagedgen.kernels.cpu import backend as cpu_backend
from pagedgen.kernels.cpu import invariant_attention, native
from paged_batch import make_paged_batch
from test_kv_quant import FORMATS, dequantized, quantize_pool
from window_cases import (dense_windowed_attention, poison_dropped_blocks, window_batch_lens,
                          windowed_batch)

SCALE = 0.3
# (head_dim, query heads per kv head): the Gemma 3 shape (256, 4) among them
SHAPES = [(64, 1), (128, 2), (256, 4)]


def windows(block_size: int) -> list[int]:
    """Windows of one key, not a multiple of the block, one block, and over two blocks."""
    return [1, 5, block_size, 2 * block_size + 3]


@pytest.fixture
def torch_only(monkeypatch):
    """The torch paths: the C library reported unavailable."""
    monkeypatch.setattr(native, "load", lambda: None)


def _expected(batch, window, scale=SCALE, **overrides):
    args = list(batch.attention_args())
    for index, name in ((0, "query"), (1, "k_cache"), (2, "v_cache")):
        args[index] = overrides.get(name, args[index])
    return reference.paged_attention(*args, scale, sliding_window=window)


# --- the oracle ------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 3, 8, 13, 40])
def test_reference_window_matches_dense_band_attention(window):
    gen = torch.Generator().manual_seed(window)
    block_size, length = 8, 37
    k, v = torch.randn(2, length, 2, 16, generator=gen).unbind(0)
    q = torch.randn(length, 4, 16, generator=gen)
    tables = torch.randperm(5, generator=gen)[None].int()
    k_cache = torch.randn(5, block_size, 2, 16, generator=gen)
    v_cache = torch.randn(5, block_size, 2, 16, generator=gen)
    for i in range(length):
        k_cache[tables[0, i // block_size], i % block_size] = k[i]
        v_cache[tables[0, i // block_size], i % block_size] = v[i]
    expected = dense_windowed_attention(q, k, v, SCALE, window)
    for q_len in (length, 1, 11):  # a whole prefill, a decode, a chunk after cached context
        out = reference.paged_attention(q[-q_len:], k_cache, v_cache, tables,
                                        torch.tensor([length]).int(),
                                        torch.tensor([0, q_len]).int(), SCALE,
                                        sliding_window=window)
        torch.testing.assert_close(out, expected[-q_len:], atol=1e-5, rtol=1e-5)


def test_window_wider_than_every_context_is_full_attention():
    batch = windowed_batch(8, 13, num_q_heads=4, num_kv_heads=2, head_dim=16)
    full = reference.paged_attention(*batch.attention_args(), SCALE)
    for ops in (reference, cpu_backend):
        wide = ops.paged_attention(*batch.attention_args(), SCALE, sliding_window=10_000)
        torch.testing.assert_close(wide, full, atol=1e-5, rtol=1e-5)


# --- the torch paths of the CPU backend ----------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_dim,group", SHAPES)
def test_torch_window_attention_matches_reference(torch_only, block_size, head_dim, group):
    for window in windows(block_size):
        batch = windowed_batch(block_size, window, num_q_heads=2 * group, num_kv_heads=2,
                               head_dim=head_dim, seed=window)
        expected = _expected(batch, window)
        assert poison_dropped_blocks(batch, window) > 0
        plan = cpu_backend.plan_attention(batch.block_tables, batch.seq_lens,
                                          batch.query_start_loc, block_size, window)
        out = cpu_backend.paged_attention(*batch.attention_args(), SCALE, plan=plan,
                                          sliding_window=window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_torch_window_attention_on_8bit_pools(torch_only, fmt_name):
    block_size, window = 8, 11
    batch = windowed_batch(block_size, window, num_q_heads=4, num_kv_heads=2, head_dim=64)
    k, v, ks, vs = quantize_pool(batch.k_cache, batch.v_cache, fmt_name)
    expected = _expected(batch, window, k_cache=dequantized(k, ks), v_cache=dequantized(v, vs))
    assert poison_dropped_blocks(batch, window, ks, vs) > 0  # NaN scales: any read shows
    out = cpu_backend.paged_attention(batch.query, k, v, *batch.attention_args()[3:], SCALE,
                                      k_scales=ks, v_scales=vs, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_torch_window_attention_bfloat16(torch_only):
    block_size, window = 16, 21
    batch = windowed_batch(block_size, window, num_q_heads=8, num_kv_heads=2, head_dim=256,
                           dtype=torch.bfloat16)
    expected = _expected(batch, window, query=batch.query.float(),
                         k_cache=batch.k_cache.float(), v_cache=batch.v_cache.float())
    poison_dropped_blocks(batch, window)
    out = cpu_backend.paged_attention(*batch.attention_args(), SCALE,
                                      sliding_window=window)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_chunked_prefill_longer_than_the_window_equals_one_prefill(torch_only):
    # The same 70 tokens attended in chunks of 25 (each longer than the window of 9) and at once.
    block_size, window, length = 8, 9, 70
    whole = make_paged_batch([length], [length], num_q_heads=4, num_kv_heads=2, head_dim=32,
                             block_size=block_size, seed=3)
    at_once = cpu_backend.paged_attention(*whole.attention_args(), SCALE, sliding_window=window)
    for begin in range(0, length, 25):
        end = min(begin + 25, length)
        out = cpu_backend.paged_attention(
            whole.query[begin:end], whole.k_cache, whole.v_cache, whole.block_tables,
            torch.tensor([end]).int(), torch.tensor([0, end - begin]).int(), SCALE,
            sliding_window=window)
        torch.testing.assert_close(out, at_once[begin:end], atol=1e-5, rtol=1e-5)


def test_plan_built_for_another_window_is_refused():
    batch = windowed_batch(8, 5, num_q_heads=2, num_kv_heads=2, head_dim=8)
    plan = cpu_backend.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                      8, 5)
    with pytest.raises(ValueError, match="sliding_window 5"):
        cpu_backend.paged_attention(*batch.attention_args(), SCALE, plan=plan)
    with pytest.raises(ValueError, match="sliding_window must be an int >= 0"):
        cpu_backend.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                   8, -1)


# --- batch-invariant attention --------------------------------------------------------------

@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("head_dim,group", SHAPES)
def test_invariant_window_attention_matches_reference_and_each_row_alone(
        use_native, head_dim, group, monkeypatch):
    if not use_native:
        monkeypatch.setattr(native, "load", lambda: None)
    block_size, window = 8, 13
    batch = windowed_batch(block_size, window, num_q_heads=2 * group, num_kv_heads=2,
                           head_dim=head_dim, seed=head_dim)
    expected = _expected(batch, window)
    poison_dropped_blocks(batch, window)
    out = invariant_attention.paged_attention(*batch.attention_args(), SCALE,
                                              sliding_window=window)
    torch.testing.assert_close(out, expected, atol=5e-5, rtol=5e-5)
    # the last row of the longest chunk, attended as a decode of its own: the same bits
    seq_lens, q_lens = window_batch_lens(block_size, window)
    row = int(batch.query_start_loc[5 + 1]) - 1
    alone = invariant_attention.paged_attention(
        batch.query[row:row + 1], batch.k_cache, batch.v_cache, batch.block_tables[5:6],
        torch.tensor([seq_lens[5]]).int(), torch.tensor([0, 1]).int(), SCALE,
        sliding_window=window)
    assert torch.equal(alone[0], out[row])


# --- the native decode kernels --------------------------------------------------------------

needs_native = pytest.mark.skipif(native.load() is None, reason="no C compiler here")


def _decode_batch(block_size, window, head_dim, group, dtype, seed=0):
    """Decodes only: shorter than, at, just past and far past the window."""
    lens = [1, window, window + 1, 3 * window + block_size + 7, 5 * block_size + 2, 2]
    return make_paged_batch(lens, [1] * len(lens), num_q_heads=2 * group, num_kv_heads=2,
                            head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)


def _native_decode(batch, window, scale, quantized=None):
    plan = cpu_backend.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                      batch.k_cache.shape[1], window)
    out = torch.full_like(batch.query, float("nan"))
    if quantized is None:
        ran = native.decode_attention(batch.query, batch.k_cache, batch.v_cache,
                                      plan.decode.tables, plan.decode.lens, scale, out, window)
    else:
        ran = native.decode_attention_q8(batch.query, *quantized, plan.decode.tables,
                                         plan.decode.lens, scale, out, window)
    assert ran, "the native kernel declined"
    return out


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim,group", SHAPES + [(256, 1), (256, 2), (64, 3)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_native_window_decode_matches_reference(dtype, tol, head_dim, group, block_size,
                                                each_decode_kernel):
    for window in windows(block_size):
        batch = _decode_batch(block_size, window, head_dim, group, dtype, seed=window)
        expected = _expected(batch, window, scale=head_dim ** -0.5,
                             query=batch.query.float(), k_cache=batch.k_cache.float(),
                             v_cache=batch.v_cache.float())
        assert poison_dropped_blocks(batch, window) > 0
        out = _native_decode(batch, window, head_dim ** -0.5)
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@needs_native
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 1, 8), (128, 2, 16), (256, 4, 16)])
def test_native_window_decode_on_8bit_pools(fmt_name, dtype, head_dim, group, block_size):
    # block_size 16 runs the AVX-512 8-bit kernel where the CPU has it, 8 the portable loop
    window = block_size + 5
    batch = _decode_batch(block_size, window, head_dim, group, dtype, seed=head_dim)
    k, v, ks, vs = quantize_pool(batch.k_cache.float(), batch.v_cache.float(), fmt_name)
    expected = _expected(batch, window, scale=head_dim ** -0.5, query=batch.query.float(),
                         k_cache=dequantized(k, ks), v_cache=dequantized(v, vs))
    assert poison_dropped_blocks(batch, window, ks, vs) > 0
    out = _native_decode(batch, window, head_dim ** -0.5, quantized=(k, v, ks, vs))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


# --- the native prefill kernels (AMX where present, and the AVX-512 BF16 one itself) -------

def _prefill_chunks(batch, window):
    plan = cpu_backend.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                      batch.k_cache.shape[1], window)
    assert plan.prefills
    return plan.prefills


needs_prefill = pytest.mark.skipif(
    native.load() is None or native.prefill_attention_path(4, 1, 64) == "torch sdpa",
    reason="no native bf16 prefill kernel on this CPU")


def _avx512_prefill(query, k_cache, v_cache, blocks, context_len, scale, out, window) -> bool:
    """The AVX-512 BF16 entry itself: native.prefill_attention takes AMX first where present."""
    q_len, num_q_heads, head_dim = query.shape
    return native.load().prefill_attention_avx512_bf16(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        blocks.data_ptr(), context_len, q_len, out.data_ptr(), num_q_heads, k_cache.shape[2],
        head_dim, k_cache.shape[1], scale, window, torch.get_num_threads()) == 0


@needs_prefill
@pytest.mark.usefixtures("each_prefill_form")
@pytest.mark.parametrize("entry", ["dispatch", "avx512"])
@pytest.mark.parametrize("head_dim,group", SHAPES + [(256, 1), (256, 2)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_native_window_prefill_matches_reference(entry, head_dim, group, block_size):
    prefill = native.prefill_attention
    if entry == "avx512":
        if not native.load().prefill_attention_avx512_supported(2 * group, 2, head_dim):
            pytest.skip("no AVX-512 BF16 prefill kernel on this CPU")
        prefill = _avx512_prefill
    for window in windows(block_size) + [40]:
        batch = windowed_batch(block_size, window, num_q_heads=2 * group, num_kv_heads=2,
                               head_dim=head_dim, dtype=torch.bfloat16, seed=window)
        scale = head_dim ** -0.5
        expected = _expected(batch, window, scale=scale, query=batch.query.float(),
                             k_cache=batch.k_cache.float(), v_cache=batch.v_cache.float())
        assert poison_dropped_blocks(batch, window) > 0
        for chunk in _prefill_chunks(batch, window):
            rows = slice(chunk.begin, chunk.end)
            out = torch.full_like(batch.query[rows], float("nan"))
            assert prefill(batch.query[rows], batch.k_cache, batch.v_cache, chunk.blocks,
                           chunk.context_len, scale, out, window)
            torch.testing.assert_close(out.float(), expected[rows], atol=2e-2, rtol=2e-2)


needs_q8_prefill = pytest.mark.skipif(
    native.load() is None or not native.load().prefill_attention_avx512_supported(4, 1, 64),
    reason="no native 8-bit prefill kernel on this CPU (it needs AVX-512 BF16)")


@needs_q8_prefill
@pytest.mark.usefixtures("each_prefill_form")
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("head_dim,group", [(64, 1), (256, 4)])
def test_native_window_prefill_on_8bit_pools(fmt_name, head_dim, group):
    block_size, window = 16, 21
    batch = windowed_batch(block_size, window, num_q_heads=2 * group, num_kv_heads=2,
                           head_dim=head_dim, dtype=torch.bfloat16, seed=5)
    k, v, ks, vs = quantize_pool(batch.k_cache.float(), batch.v_cache.float(), fmt_name)
    scale = head_dim ** -0.5
    expected = _expected(batch, window, scale=scale, query=batch.query.float(),
                         k_cache=dequantized(k, ks), v_cache=dequantized(v, vs))
    assert poison_dropped_blocks(batch, window, ks, vs) > 0
    for chunk in _prefill_chunks(batch, window):
        rows = slice(chunk.begin, chunk.end)
        out = torch.full_like(batch.query[rows], float("nan"))
        assert native.prefill_attention_q8(batch.query[rows], k, v, ks, vs, chunk.blocks,
                                           chunk.context_len, scale, out, window)
        torch.testing.assert_close(out.float(), expected[rows], atol=2e-2, rtol=2e-2)


def _record_native_calls(monkeypatch) -> list[tuple[str, bool]]:
    calls = []
    for name in ("decode_attention", "decode_attention_q8", "prefill_attention",
                 "prefill_attention_q8"):
        def recorded(*args, _real=getattr(native, name), _name=name):
            calls.append((_name, _real(*args)))
            return calls[-1][1]
        monkeypatch.setattr(native, name, recorded)
    return calls


@needs_prefill
@pytest.mark.usefixtures("each_prefill_form")
@pytest.mark.parametrize("fmt_name", [None, "int8"])
def test_backend_window_attention_with_native_kernels(fmt_name, monkeypatch):
    # the whole dispatch: decodes and prefill chunks of one step, bf16, poisoned blocks
    if fmt_name and not native.load().prefill_attention_avx512_supported(8, 2, 256):
        pytest.skip("no native 8-bit prefill kernel on this CPU (it needs AVX-512 BF16)")
    calls = _record_native_calls(monkeypatch)
    block_size, window = 16, 19
    batch = windowed_batch(block_size, window, num_q_heads=8, num_kv_heads=2, head_dim=256,
                           dtype=torch.bfloat16, seed=11)
    kv = {}
    k_cache, v_cache = batch.k_cache.float(), batch.v_cache.float()
    if fmt_name:
        k, v, ks, vs = quantize_pool(k_cache, v_cache, fmt_name)
        k_cache, v_cache = dequantized(k, ks), dequantized(v, vs)
        kv = {"k_cache": k, "v_cache": v}
        poison_dropped_blocks(batch, window, ks, vs)
    expected = _expected(batch, window, scale=1 / 16, query=batch.query.float(),
                         k_cache=k_cache, v_cache=v_cache)
    poison_dropped_blocks(batch, window)
    args = list(batch.attention_args())
    extra = {}
    if fmt_name:
        args[1], args[2] = kv["k_cache"], kv["v_cache"]
        extra = {"k_scales": ks, "v_scales": vs}
    out = cpu_backend.paged_attention(*args, 1 / 16, sliding_window=window, **extra)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert {name.split("_")[0] for name, _ in calls} == {"decode", "prefill"}
    assert all(ran for _, ran in calls), calls


@needs_native
@pytest.mark.parametrize("fmt_name", [None, "int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 2), (256, 4)])
def test_native_window_decode_skips_blocks_through_whole_tables(fmt_name, dtype, head_dim,
                                                                 group):
    # The fused decode step hands the kernels the sequences' whole tables: the kernels
    # themselves must start at the window's block.
    block_size, window = 16, 21
    batch = _decode_batch(block_size, window, head_dim, group, dtype, seed=3)
    tables, lens = batch.block_tables.long(), batch.seq_lens.long()
    out = torch.full_like(batch.query, float("nan"))
    k_cache, v_cache = batch.k_cache.float(), batch.v_cache.float()
    if fmt_name is None:
        poison_dropped_blocks(batch, window)  # after the oracle's copies were taken
        ran = native.decode_attention(batch.query, batch.k_cache, batch.v_cache, tables, lens,
                                      0.1, out, window)
    else:
        k, v, ks, vs = quantize_pool(k_cache, v_cache, fmt_name)
        k_cache, v_cache = dequantized(k, ks), dequantized(v, vs)
        poison_dropped_blocks(batch, window, ks, vs)
        ran = native.decode_attention_q8(batch.query, k, v, ks, vs, tables, lens, 0.1, out,
                                         window)
    assert ran
    expected = _expected(batch, window, scale=0.1, query=batch.query.float(), k_cache=k_cache,
                         v_cache=v_cache)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
