"""Prefill attention on an 8-bit pool with the AVX-512 BF16 kernel
(kernels/cpu/prefill_attention_avx512.c, codes decoded in place): against a float32 reference
over the dequantized blocks, against the gather + dequantize + SDPA path, and in the engine."""
from __future__ import annotations

import pytest
import torch

from pagedgen.kernels import reference
from pagedgen.kernels.cpu import backend as cpu_backend

from pagedgen.kernels.cpu import native
from paged_batch import make_paged_batch
from test_kv_quant import FORMAT_ATOL, FORMATS, dequantized, quantize_pool
from test_native_prefill_avx512 import (_head_dim_64_model, assert_agree_up_to_near_ties,
                                        needs_avx512_bf16, shared_prefix_prompts)

# every test here runs each form of the AVX-512 BF16 kernel, on any CPU that has it
pytestmark = pytest.mark.usefixtures("each_prefill_form")

# The kernel's error beyond the reference: P rounded to bf16 before P V and the bf16 output
# (2^-9 relative each); the codes themselves are decoded exactly and scaled in float32.
TOL = 1e-2


def _case(q_len, context_len, q_heads, kv_heads, head_dim, block_size, fmt_name, seed):
    """Blocks out of order with spare ones around; the blocks' magnitudes vary over decades
    (each block its own scales; fp8 subnormal codes) and the query is a row-strided view."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-context_len // block_size)
    shape = (num_blocks + 5, block_size, kv_heads, head_dim)
    magnitude = 10.0 ** (-3 * torch.rand(num_blocks + 5, 1, kv_heads, 1, generator=gen))
    k, v, ks, vs = quantize_pool(3 * torch.randn(shape, generator=gen) * magnitude,
                                 torch.randn(shape, generator=gen) * magnitude.flip(0), fmt_name)
    blocks = torch.randperm(num_blocks + 5, generator=gen)[:num_blocks].contiguous()
    qkv = (2 * torch.randn(q_len, q_heads + 2 * kv_heads, head_dim, generator=gen)).bfloat16()
    return qkv[:, :q_heads], (k, v, ks, vs), blocks


def _expected(query, pool, blocks, context_len, scale):
    k, v, ks, vs = pool
    return reference.paged_attention(
        query.float().contiguous(), dequantized(k, ks), dequantized(v, vs), blocks[None].int(),
        torch.tensor([context_len], dtype=torch.int32),
        torch.tensor([0, query.shape[0]], dtype=torch.int32), scale)


@needs_avx512_bf16
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("q_len,context_len", [(1, 1), (17, 17), (70, 70), (5, 37), (48, 311)])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (8, 2, 128, 8), (3, 1, 64, 32), (4, 4, 64, 24)])
def test_q8_prefill_matches_the_dequantized_reference(fmt_name, q_len, context_len, q_heads,
                                                      kv_heads, head_dim, block_size):
    query, pool, blocks = _case(q_len, context_len, q_heads, kv_heads, head_dim, block_size,
                                fmt_name, seed=q_len * 1000 + context_len + block_size)
    out = torch.full((q_len, q_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    assert native.prefill_attention_q8(query, *pool, blocks, context_len, scale, out)
    expected = _expected(query, pool, blocks, context_len, scale)
    torch.testing.assert_close(out.float(), expected, atol=TOL * float(expected.abs().max()),
                               rtol=TOL)


@needs_avx512_bf16
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_q8_prefill_is_the_format_s_error_away_from_the_unquantized_pool(fmt_name):
    # The same K/V unquantized (float32): what a user gives up by choosing the format, plus the
    # bf16 rounding of P and of the output (0.02 at outputs of this size).
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 6, 16, 3, 64, generator=gen).unbind(0)
    pool = quantize_pool(k, v, fmt_name)
    query = torch.randn(40, 9, 64, generator=gen).bfloat16()
    blocks = torch.arange(6)
    out = torch.empty(40, 9, 64, dtype=torch.bfloat16)
    assert native.prefill_attention_q8(query, *pool, blocks, 90, 0.125, out)
    exact = reference.paged_attention(
        query.float(), k, v, blocks[None].int(), torch.tensor([90], dtype=torch.int32),
        torch.tensor([0, 40], dtype=torch.int32), 0.125)
    torch.testing.assert_close(out.float(), exact, atol=FORMAT_ATOL[fmt_name] + 0.02, rtol=0)
    assert float((out.float() - exact).abs().mean()) > 0  # lossy: the codes are not the values


@needs_avx512_bf16
@pytest.mark.parametrize("threads", [1, 3, 16])
def test_q8_prefill_with_thread_counts_that_split_groups(threads, monkeypatch):
    query, pool, blocks = _case(40, 90, 8, 2, 64, 16, "int8", seed=threads)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    out = torch.empty(40, 8, 64, dtype=torch.bfloat16)
    assert native.prefill_attention_q8(query, *pool, blocks, 90, 0.125, out)
    expected = _expected(query, pool, blocks, 90, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=TOL * float(expected.abs().max()),
                               rtol=TOL)


@needs_avx512_bf16
def test_q8_prefill_declines_what_it_does_not_cover():
    query, (k, v, ks, vs), blocks = _case(4, 4, 2, 1, 64, 16, "int8", seed=1)
    out = torch.empty(4, 2, 64, dtype=torch.bfloat16)
    assert not native.prefill_attention_q8(query.float(), k, v, ks, vs, blocks, 4, 1.0,
                                           out.float())  # float32 queries
    assert not native.prefill_attention_q8(query, k.float(), v.float(), ks, vs, blocks, 4, 1.0,
                                           out)  # not codes
    assert not native.prefill_attention_q8(query, k, v, ks, vs, blocks, 3, 1.0, out)  # q > ctx
    small = query[..., :32].contiguous()
    assert not native.prefill_attention_q8(small, k[..., :32].contiguous(),
                                           v[..., :32].contiguous(), ks, vs, blocks, 4, 1.0,
                                           torch.empty_like(small))  # head_dim 32


@needs_avx512_bf16
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_chunks_of_a_batch_match_the_gather_path(fmt_name, monkeypatch):
    """cpu_backend's dispatch: prefill chunks with and without cached context beside decodes,
    native against gather + dequantize + SDPA (both bf16; they round differently)."""
    batch = make_paged_batch([40, 100, 1, 77, 16], [40, 30, 1, 1, 9], num_q_heads=9,
                             num_kv_heads=3, head_dim=64, block_size=16, seed=5)
    k, v, ks, vs = quantize_pool(batch.k_cache, batch.v_cache, fmt_name)
    args = (batch.query.bfloat16(), k, v, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, 0.125)
    calls = []
    dispatch = native.prefill_attention_q8

    def counted(*a):
        calls.append(dispatch(*a))
        return calls[-1]

    monkeypatch.setattr(native, "prefill_attention_q8", counted)
    fast = cpu_backend.paged_attention(*args, k_scales=ks, v_scales=vs)
    assert calls == [True, True, True]  # the three prefill chunks
    monkeypatch.setattr(native, "prefill_attention_q8", lambda *a: False)
    slow = cpu_backend.paged_attention(*args, k_scales=ks, v_scales=vs)
    torch.testing.assert_close(fast.float(), slow.float(), atol=2e-2, rtol=2e-2)
    expected = reference.paged_attention(args[0].float(), dequantized(k, ks), dequantized(v, vs),
                                         *args[3:])
    torch.testing.assert_close(fast.float(), expected, atol=TOL, rtol=TOL)


@needs_avx512_bf16
def test_engine_on_an_int8_pool_matches_the_gather_path(tmp_path, monkeypatch):
    # As test_native_prefill_avx512's engine test, on an int8 pool: chunked prefills over a
    # cached context and a prefix hit; near-ties of the random model may part greedy texts.
    from pagedgen import LLM, SamplingParams

    model = _head_dim_64_model(tmp_path)
    prompts = shared_prefix_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2,
                            prompt_logprobs=0)
    calls = []
    dispatch = native.prefill_attention_q8

    def counted(*args):
        calls.append(dispatch(*args))
        return calls[-1]

    runs = {}
    for path in ("native", "gather"):
        monkeypatch.setattr(native, "prefill_attention_q8",
                            counted if path == "native" else lambda *args: False)
        llm = LLM(model, dtype="bfloat16", threads=1, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=48, kv_cache_dtype="int8")
        runs[path] = llm.generate(prompts, params, use_tqdm=False)
    assert calls and all(calls)
    assert_agree_up_to_near_ties(runs["native"], runs["gather"])
