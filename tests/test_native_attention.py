"""The C decode-attention kernels against the reference: the portable loop
(kernels/cpu/decode_attention.c) and, for bfloat16, the vector kernels the same entry point
tries first: AVX-512 BF16 (kernels/cpu/decode_attention_bf16.c) and AVX2
(kernels/cpu/decode_attention_avx2.c); each_decode_kernel runs each one the CPU can, the
portable loop included."""
import pytest
import torch

from pagedgen.kernels import reference
from pagedgen.kernels.cpu import native

from pagedgen.kernels.cpu import backend as cpu_backend


def _decode_case(num_seqs, q_heads, kv_heads, head_dim, block_size, dtype, seed=0,
                 max_len=None):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len or 5 * block_size, (num_seqs,), generator=gen)
    blocks_per_seq = int((lens.max() + block_size - 1) // block_size)
    num_blocks = num_seqs * blocks_per_seq + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    # Blocks out of order, as the pool hands them out after a while.
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * blocks_per_seq]
    query = torch.randn(num_seqs, q_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables.view(num_seqs, blocks_per_seq), lens


needs_native = pytest.mark.skipif(native.load() is None, reason="no C compiler here")


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 32), (6, 2, 24, 16), (12, 3, 16, 8),
    (9, 3, 64, 8), (8, 1, 64, 64), (16, 2, 128, 16), (4, 4, 128, 8)])
def test_native_decode_matches_reference(dtype, tol, q_heads, kv_heads, head_dim, block_size,
                                         each_decode_kernel):
    # Lengths up to 300 cross many blocks and leave partial 16-key chunks at the ends.
    query, k_cache, v_cache, tables, lens = _decode_case(6, q_heads, kv_heads, head_dim,
                                                         block_size, dtype, max_len=300)
    out = torch.full_like(query, float("nan"))
    scale = head_dim ** -0.5
    assert native.decode_attention(query, k_cache, v_cache, tables.contiguous(), lens, scale, out)
    expected = reference.paged_attention(query, k_cache, v_cache, tables.int(), lens.int(),
                                         torch.arange(len(lens) + 1, dtype=torch.int32), scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_reads_a_row_strided_query(dtype, each_decode_kernel):
    # The model passes q as a view of the fused QKV output: rows H_q + 2 * H_kv heads apart.
    query, k_cache, v_cache, tables, lens = _decode_case(5, 9, 3, 64, 16, dtype, max_len=100)
    qkv = torch.randn(5, 15, 64).to(dtype)
    qkv[:, :9] = query
    strided = qkv[:, :9]
    assert not strided.is_contiguous()
    got, expected = torch.empty_like(query), torch.empty_like(query)
    assert native.decode_attention(strided, k_cache, v_cache, tables, lens, 0.125, got)
    assert native.decode_attention(query, k_cache, v_cache, tables, lens, 0.125, expected)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@needs_native
def test_native_kernel_declines_unsupported_input():
    query, k_cache, v_cache, tables, lens = _decode_case(2, 4, 2, 32, 8, torch.float16)
    out = torch.empty_like(query)
    assert not native.decode_attention(query, k_cache, v_cache, tables, lens, 0.1, out)
    query, k_cache, v_cache, tables, lens = _decode_case(2, 4, 2, 32, 8, torch.float32)
    assert not native.decode_attention(query, k_cache, v_cache, tables.int(), lens, 0.1, out)


def test_torch_path_used_when_native_is_switched_off(monkeypatch):
    monkeypatch.setenv("PAGEDGEN_NATIVE_KERNELS", "0")
    native.load.cache_clear()
    try:
        assert native.load() is None
        query, k_cache, v_cache, tables, lens = _decode_case(5, 6, 2, 32, 16, torch.float32)
        starts = torch.arange(len(lens) + 1, dtype=torch.int32)
        got = cpu_backend.paged_attention(query, k_cache, v_cache, tables.int(), lens.int(),
                                        starts, 0.2)
        expected = reference.paged_attention(query, k_cache, v_cache, tables.int(), lens.int(),
                                             starts, 0.2)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    finally:
        native.load.cache_clear()


def test_failed_compile_warns_in_one_line_and_falls_back(monkeypatch, tmp_path):
    # A "compiler" that fails the way gcc does: notes first, then errors, over many lines.
    compiler = tmp_path / "failing-cc"
    compiler.write_text("#!/bin/sh\n"
                        "echo 'cpu_decode_attention.c: In function f:' >&2\n"
                        "echo 'cpu_decode_attention.c:3:1: error: unknown type name x' >&2\n"
                        "echo '    3 | x y;' >&2\n"
                        "echo 'cpu_decode_attention.c:9:2: error: second problem' >&2\n"
                        "exit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDGEN_NATIVE_KERNELS", raising=False)
    native.load.cache_clear()
    try:
        with pytest.warns(UserWarning) as caught:
            assert native.load() is None
        (message,) = [str(w.message) for w in caught]
        assert "\n" not in message
        assert "cpu_decode_attention.c:3:1: error: unknown type name x" in message
        assert "second problem" not in message and "set PAGEDGEN_NATIVE_KERNELS=0 to silence" in message
        query, k_cache, v_cache, tables, lens = _decode_case(3, 4, 2, 32, 8, torch.float32)
        starts = torch.arange(len(lens) + 1, dtype=torch.int32)
        got = cpu_backend.paged_attention(query, k_cache, v_cache, tables.int(), lens.int(), starts, 0.2)
        expected = reference.paged_attention(query, k_cache, v_cache, tables.int(), lens.int(),
                                             starts, 0.2)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    finally:
        native.load.cache_clear()


def _prefill_supported() -> bool:
    q = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)
    return native.prefill_attention(q, cache, cache, torch.zeros(1, dtype=torch.int64), 1, 1.0,
                                    torch.empty_like(q))


needs_amx_prefill = pytest.mark.skipif(not _prefill_supported(),
                                       reason="no native prefill attention here")


@needs_amx_prefill
@pytest.mark.parametrize("q_len,context_len", [(1, 1), (5, 5), (33, 33), (100, 300), (17, 50),
                                               (300, 300), (64, 64)])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 128, 32), (8, 2, 128, 8), (12, 3, 64, 16), (8, 2, 256, 16),
    (14, 2, 64, 16)])  # 7 query heads per kv head: more than one work item takes together
def test_native_prefill_matches_reference(q_len, context_len, q_heads, kv_heads, head_dim,
                                          block_size):
    # A chunk of q_len queries at the end of its context (context_len > q_len: cached prefix),
    # blocks out of order, the query a row-strided view of a wider QKV row.
    gen = torch.Generator().manual_seed(q_len * 1000 + context_len)
    num_blocks = -(-context_len // block_size)
    k_cache = torch.randn(num_blocks + 4, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks + 4, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    blocks = torch.randperm(num_blocks + 4, generator=gen)[:num_blocks]
    qkv = torch.randn(q_len, q_heads + 2 * kv_heads, head_dim, generator=gen).bfloat16()
    query = qkv[:, :q_heads]
    out = torch.full((q_len, q_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    assert native.prefill_attention(query, k_cache, v_cache, blocks, context_len, scale, out)
    expected = reference.paged_attention(
        query.float().contiguous(), k_cache.float(), v_cache.float(), blocks[None].int(),
        torch.tensor([context_len], dtype=torch.int32),
        torch.tensor([0, q_len], dtype=torch.int32), scale)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_amx_prefill
def test_native_prefill_declines_what_it_does_not_cover():
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16)
    blocks = torch.zeros(1, dtype=torch.int64)
    out = torch.empty_like(q)
    assert not native.prefill_attention(q.float(), cache.float(), cache.float(), blocks, 4, 1.0,
                                        out.float())  # float32: SDPA
    assert not native.prefill_attention(q, cache, cache, blocks, 17, 1.0, out)  # past the table
    assert not native.prefill_attention(q, cache, cache, blocks, 3, 1.0, out)  # q_len > context
    small = torch.zeros(4, 2, 32, dtype=torch.bfloat16)
    assert not native.prefill_attention(small, cache[..., :32], cache[..., :32], blocks, 4, 1.0,
                                        torch.empty_like(small))  # head_dim 32
