"""Quantized KV pools (kernels/kv_quant.py): round trip within the documented bound, attention
on the codes against a float32 reference over the dequantized blocks, and scales that follow
their blocks through copy-on-write."""
from __future__ import annotations

import pytest
import torch

from pagedgen.kernels import reference
from pagedgen.kernels.cpu import backend as cpu_backend
from pagedgen.kernels.kv_quant import (KV_CACHE_DTYPES, dequantize, error_bound, kv_format,
                                       store_kv_quantized)
from paged_batch import make_paged_batch

FORMATS = [name for name in KV_CACHE_DTYPES if name != "auto"]
SCALE = 0.25
# Attention output error against the unquantized pool, random normal K/V (|v| up to ~4) and
# queries: worst case a V element's own error (a one-key row returns v itself) -- int8: half a
# step of max/127; e4m3: 2^-4 relative; e5m2: 2^-3 -- and on average far less.
FORMAT_ATOL = {"int8": 0.03, "fp8_e4m3": 0.25, "fp8_e5m2": 0.5}
FORMAT_MEAN = {"int8": 0.008, "fp8_e4m3": 0.02, "fp8_e5m2": 0.04}


def empty_pool(fmt_name: str, num_blocks: int, block_size: int, heads: int, dim: int):
    fmt = kv_format(fmt_name)
    shape = (num_blocks, block_size, heads, dim)
    return (torch.zeros(shape, dtype=fmt.storage), torch.zeros(shape, dtype=fmt.storage),
            torch.zeros(num_blocks, heads), torch.zeros(num_blocks, heads))


def dequantized(cache, scales):
    return dequantize(cache, scales[:, None, :, None])


def quantize_pool(k_float, v_float, fmt_name: str):
    """Every block of float pools written in one store call (the prefill case)."""
    num_blocks, block_size, heads, dim = k_float.shape
    k, v, ks, vs = empty_pool(fmt_name, num_blocks, block_size, heads, dim)
    slots = torch.arange(num_blocks * block_size)
    store_kv_quantized(k_float.reshape(-1, heads, dim), v_float.reshape(-1, heads, dim), k, v,
                       slots, ks, vs)
    return k, v, ks, vs


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_round_trip_of_whole_blocks_is_within_the_bound(fmt_name):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, 2, 32, generator=gen) * torch.tensor([0.01, 30.0])[None, None, :, None]
    x[2, 5, 1, 7] = 900.0  # an outlier inflates only its own block and head's scale
    k, _, ks, _ = quantize_pool(x, x.clone(), fmt_name)
    fmt = kv_format(fmt_name)
    torch.testing.assert_close(ks, x.abs().amax(dim=(1, 3)) / fmt.qmax)
    err = (dequantized(k, ks) - x).abs()
    assert bool((err <= error_bound(fmt, x, ks[:, None, :, None]) + 1e-12).all())
    # The small head keeps its own fine scale (shared with the outlier's, int8's step is 7).
    assert float(err[:, :, 0].max()) < 0.07 * float(x[:, :, 0].abs().max())


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_token_by_token_writes_requantize_within_the_bound(fmt_name):
    """Decode writes one token at a time: the scale grows with the running max and the
    block is re-quantized; the bound counts those re-quantizations."""
    gen = torch.Generator().manual_seed(1)
    block_size, heads, dim = 8, 2, 16
    tokens = torch.randn(block_size, heads, dim, generator=gen) * torch.linspace(0.5, 4, 8)[:, None, None]
    k, v, ks, vs = empty_pool(fmt_name, 3, block_size, heads, dim)
    k.view(torch.uint8).fill_(7)  # a previous owner's codes and scales: offset 0 must reset them
    ks.fill_(100.0)
    requants = torch.zeros(heads, dtype=torch.int64)
    for t in range(block_size):
        before = ks[1].clone()
        store_kv_quantized(tokens[t:t + 1], tokens[t:t + 1], k, v, torch.tensor([block_size + t]),
                           ks, vs)
        requants += ((ks[1] > before) & (t > 0)).long()
    fmt = kv_format(fmt_name)
    torch.testing.assert_close(ks[1], tokens.abs().amax(dim=(0, 2)) / fmt.qmax)
    err = (dequantized(k, ks)[1] - tokens).abs()
    bound = error_bound(fmt, tokens, ks[1][None, :, None], int(requants.max()))
    assert bool((err <= bound + 1e-12).all())
    assert int(requants.max()) >= 1  # the case under test did re-quantize
    assert bool((ks[0] == 100.0).all() & (ks[2] == 100.0).all())  # other blocks untouched


def test_skipped_slots_and_unchanged_scales_leave_codes_exact():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 1, 16, generator=gen)
    k, v, ks, vs = quantize_pool(x, x.clone(), "int8")
    codes = k.clone()
    small = x[0, :1] * 0.01  # below the block's max: the scale does not change
    store_kv_quantized(torch.cat([small, small]), torch.cat([small, small]), k, v,
                       torch.tensor([-1, 15]), ks, vs)  # slot -1: not stored
    assert torch.equal(k[0], codes[0]) and torch.equal(k[1, :7], codes[1, :7])


def test_bad_kv_cache_dtype_names_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        kv_format("fp4")


def mixed_lens(b: int) -> tuple[list[int], list[int]]:
    return [1, b, b + 1, 3 * b - 1, b + 3, 2 * b + 5, 1], [1, 1, 1, 1, b + 3, 7, 1]


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_attention_on_codes_matches_the_dequantized_reference(fmt_name, block_size):
    seq_lens, q_lens = mixed_lens(block_size)
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=4, num_kv_heads=2, head_dim=32,
                             block_size=block_size, seed=3)
    k, v, ks, vs = quantize_pool(batch.k_cache, batch.v_cache, fmt_name)
    args = (batch.query, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE)
    out = cpu_backend.paged_attention(*args, k_scales=ks, v_scales=vs)
    # Tight: the same values, so only float32 summation order differs.
    expected = reference.paged_attention(batch.query, dequantized(k, ks), dequantized(v, vs),
                                         *args[3:])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    # Loose: the format's own error against the unquantized pool.
    exact = reference.paged_attention(*batch.attention_args(), SCALE)
    torch.testing.assert_close(out, exact, atol=FORMAT_ATOL[fmt_name], rtol=0)
    assert 0 < float((out - exact).abs().mean()) < FORMAT_MEAN[fmt_name]  # lossy, but slightly


def test_bfloat16_queries_on_an_int8_pool():
    seq_lens, q_lens = mixed_lens(16)
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=4, num_kv_heads=2, head_dim=32,
                             block_size=16, seed=4)
    k, v, ks, vs = quantize_pool(batch.k_cache, batch.v_cache, "int8")
    query = batch.query.bfloat16()
    out = cpu_backend.paged_attention(query, k, v, batch.block_tables, batch.seq_lens,
                                    batch.query_start_loc, SCALE, k_scales=ks, v_scales=vs)
    expected = reference.paged_attention(query.float(), dequantized(k, ks), dequantized(v, vs),
                                         batch.block_tables, batch.seq_lens,
                                         batch.query_start_loc, SCALE)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=0)


@pytest.mark.parametrize("fmt_name", ["int8", "fp8_e5m2"])
def test_copy_blocks_moves_codes_of_every_layer(fmt_name):
    fmt = kv_format(fmt_name)
    pool = torch.randn(2, 2, 5, 4, 1, 8).clamp(-1, 1).to(fmt.storage)
    before = pool.view(torch.uint8).clone()
    cpu_backend.copy_blocks(pool, torch.tensor([1, 3]), torch.tensor([4, 0]))
    after = pool.view(torch.uint8)
    assert torch.equal(after[:, :, 4], before[:, :, 1]) and torch.equal(after[:, :, 0], before[:, :, 3])


def native_or_skip():
    from pagedgen.kernels.cpu import native

    if native.load() is None:
        pytest.skip("no C compiler: the native kernels are unavailable")
    return native


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("head_dim,num_q_heads", [(64, 6), (32, 4), (40, 2)])  # 40: generic path
def test_native_decode_reads_codes_like_the_reference(fmt_name, head_dim, num_q_heads):
    native = native_or_skip()
    batch = make_paged_batch([1, 16, 17, 47, 100], [1] * 5, num_q_heads=num_q_heads, num_kv_heads=2,
                             head_dim=head_dim, block_size=16, seed=head_dim)
    # Magnitudes over six decades: fp8 subnormal codes must decode exactly too.
    spread = 10.0 ** (-6 * torch.rand(batch.k_cache.shape, generator=torch.Generator().manual_seed(9)))
    k, v, ks, vs = quantize_pool(batch.k_cache * spread, batch.v_cache * spread, fmt_name)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        query = batch.query.to(dtype)
        out = torch.empty_like(query)
        assert native.decode_attention_q8(query, k, v, ks, vs, batch.block_tables.long(),
                                          batch.seq_lens.long(), SCALE, out)
        expected = reference.paged_attention(query.float(), dequantized(k, ks), dequantized(v, vs),
                                             batch.block_tables, batch.seq_lens,
                                             batch.query_start_loc, SCALE)
        torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("head_dim,num_q_heads,block_size", [(128, 8, 32), (64, 16, 48)])
def test_native_decode_on_wide_heads_long_blocks_and_large_groups(fmt_name, head_dim,
                                                                  num_q_heads, block_size):
    """head_dim 128 (two 64-code words per row), several 16-key chunks per block, odd token
    counts in a chunk; bf16 queries take the integer (VNNI) int8 path where the CPU has it:
    its only error beyond the reference is the bf16 rounding of the output."""
    native = native_or_skip()
    batch = make_paged_batch([1, 15, 33, 47, 130], [1] * 5, num_q_heads=num_q_heads,
                             num_kv_heads=2, head_dim=head_dim, block_size=block_size, seed=3)
    k, v, ks, vs = quantize_pool(batch.k_cache * 3, batch.v_cache, fmt_name)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
        query = batch.query.to(dtype)
        out = torch.empty_like(query)
        assert native.decode_attention_q8(query, k, v, ks, vs, batch.block_tables.long(),
                                          batch.seq_lens.long(), SCALE, out)
        expected = reference.paged_attention(query.float(), dequantized(k, ks), dequantized(v, vs),
                                             batch.block_tables, batch.seq_lens,
                                             batch.query_start_loc, SCALE)
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_decodes_without_the_native_kernel_take_the_gather_path(monkeypatch):
    from pagedgen.kernels.cpu import native

    seq_lens, q_lens = mixed_lens(16)
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=4, num_kv_heads=2, head_dim=32,
                             block_size=16, seed=6)
    k, v, ks, vs = quantize_pool(batch.k_cache, batch.v_cache, "fp8_e4m3")
    args = (batch.query, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE)
    monkeypatch.setattr(native, "decode_attention_q8", lambda *a: False)
    out = cpu_backend.paged_attention(*args, k_scales=ks, v_scales=vs)
    expected = reference.paged_attention(batch.query, dequantized(k, ks), dequantized(v, vs),
                                         *args[3:])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_store_is_bit_identical_to_the_torch_store(fmt_name, dtype, monkeypatch):
    """Decode steps (one token per block) go to the C store; it must write the same codes and
    scales as the torch path, re-quantizations and fp8 subnormals included."""
    native = native_or_skip()
    results = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(native, "store_kv_q8", lambda *a: False)
        k, v, ks, vs = empty_pool(fmt_name, 6, 8, 2, 16)
        gen = torch.Generator().manual_seed(1)
        for t in range(8):  # growing magnitudes over six decades: scales grow, codes re-quantize
            x = (torch.randn(3, 2, 16, generator=gen) * (1 + t)
                 * 10.0 ** (-6 * torch.rand(3, 2, 16, generator=gen))).to(dtype)
            store_kv_quantized(x, x * 0.5, k, v, torch.tensor([t, 16 + t, 40 + t]), ks, vs)
        results.append((k.view(torch.uint8), v.view(torch.uint8), ks, vs))
    for native_out, torch_out in zip(*results):
        assert torch.equal(native_out, torch_out)
