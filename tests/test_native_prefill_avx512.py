"""The AVX-512 BF16 prefill attention kernel (kernels/cpu/prefill_attention_avx512.c) against
the float32 reference, and an engine run with it against the gather + SDPA fallback."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedgen.kernels import reference
from pagedgen.kernels.cpu import native

# every test here runs each form of the AVX-512 BF16 kernel, on any CPU that has it
pytestmark = pytest.mark.usefixtures("each_prefill_form")


def _has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and "avx512_bf16" in cpuinfo.read_text()


def _library():
    return native.load() if _has_avx512_bf16() else None


needs_avx512_bf16 = pytest.mark.skipif(_library() is None,
                                       reason="no AVX-512 BF16 (or no native library) here")


def _call_avx512(query, k_cache, v_cache, blocks, context_len, scale, out, threads=None,
                 window=0) -> int:
    """The AVX-512 entry itself (native.prefill_attention would take AMX first where present)."""
    q_len, num_q_heads, head_dim = query.shape
    return _library().prefill_attention_avx512_bf16(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        blocks.data_ptr(), context_len, q_len, out.data_ptr(), num_q_heads, k_cache.shape[2],
        head_dim, k_cache.shape[1], scale, window, threads or torch.get_num_threads())


def _case(q_len, context_len, q_heads, kv_heads, head_dim, block_size, seed):
    # blocks out of order with spare ones around, the query a row-strided view of a QKV row
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-context_len // block_size)
    shape = (num_blocks + 5, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    blocks = torch.randperm(num_blocks + 5, generator=gen)[:num_blocks].contiguous()
    qkv = (2 * torch.randn(q_len, q_heads + 2 * kv_heads, head_dim, generator=gen)).bfloat16()
    return qkv[:, :q_heads], k_cache, v_cache, blocks


def _expected(query, k_cache, v_cache, blocks, context_len, scale, window=0):
    q_len = query.shape[0]
    return reference.paged_attention(
        query.float().contiguous(), k_cache.float(), v_cache.float(), blocks[None].int(),
        torch.tensor([context_len], dtype=torch.int32),
        torch.tensor([0, q_len], dtype=torch.int32), scale, sliding_window=window)


@needs_avx512_bf16
@pytest.mark.parametrize("q_len,context_len", [(1, 1), (1, 37), (5, 5), (16, 16), (17, 50),
                                               (33, 33), (70, 70), (70, 600), (48, 311)])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 128, 32), (8, 2, 128, 8), (3, 1, 64, 32), (12, 3, 64, 8)])
def test_avx512_prefill_matches_reference(q_len, context_len, q_heads, kv_heads, head_dim,
                                          block_size):
    query, k_cache, v_cache, blocks = _case(q_len, context_len, q_heads, kv_heads, head_dim,
                                            block_size, seed=q_len * 1000 + context_len)
    out = torch.full((q_len, q_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    assert _call_avx512(query, k_cache, v_cache, blocks, context_len, scale, out) == 0
    expected = _expected(query, k_cache, v_cache, blocks, context_len, scale)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_avx512_bf16
@pytest.mark.parametrize("threads", [2, 5, 16])
@pytest.mark.parametrize("q_len,context_len,q_heads,kv_heads", [(1, 200, 9, 3), (20, 300, 12, 3),
                                                                (40, 90, 8, 2), (3, 3, 4, 4)])
def test_avx512_prefill_splits_groups_across_threads(threads, q_len, context_len, q_heads,
                                                     kv_heads):
    # few row blocks for the threads: an item takes part of a kv head's group of query heads
    query, k_cache, v_cache, blocks = _case(q_len, context_len, q_heads, kv_heads, 64, 16,
                                            seed=threads + q_len)
    out = torch.full((q_len, q_heads, 64), float("nan"), dtype=torch.bfloat16)
    assert _call_avx512(query, k_cache, v_cache, blocks, context_len, 0.125, out, threads) == 0
    torch.testing.assert_close(out.float(),
                               _expected(query, k_cache, v_cache, blocks, context_len, 0.125),
                               atol=2e-2, rtol=2e-2)


@needs_avx512_bf16
@pytest.mark.parametrize("q_len,context_len,window,threads", [
    (70, 70, 21, 2),     # many items: the V pairs packed once for the chunk
    (40, 300, 37, 2),    # a chunk late in the sequence: keys before every row's window skipped
    (5, 260, 100, 2),    # one row block: packed per item
    (33, 90, 16, 1)])    # a window of exactly one step
def test_avx512_prefill_sliding_window_matches_reference(q_len, context_len, window, threads):
    # windows that start mid-step: the first step's keys before a row's window are masked
    query, k_cache, v_cache, blocks = _case(q_len, context_len, 8, 2, 64, 16, seed=window)
    out = torch.full((q_len, 8, 64), float("nan"), dtype=torch.bfloat16)
    assert _call_avx512(query, k_cache, v_cache, blocks, context_len, 0.125, out, threads,
                        window) == 0
    torch.testing.assert_close(
        out.float(), _expected(query, k_cache, v_cache, blocks, context_len, 0.125, window),
        atol=2e-2, rtol=2e-2)


def assert_declines_what_no_vector_kernel_covers(call) -> None:
    """call(query, k_cache, v_cache, blocks, context_len, scale, out) -> status: 1 for each."""
    query, k_cache, v_cache, blocks = _case(4, 4, 2, 1, 64, 16, seed=1)
    out = torch.empty(4, 2, 64, dtype=torch.bfloat16)
    assert call(query, k_cache, v_cache, blocks, 3, 1.0, out) == 1  # q_len > context
    small = torch.zeros(4, 2, 32, dtype=torch.bfloat16)
    assert call(small, k_cache[..., :32].contiguous(), v_cache[..., :32].contiguous(),
                blocks, 4, 1.0, torch.empty_like(small)) == 1  # head_dim 32
    odd = torch.zeros(4, 3, 64, dtype=torch.bfloat16)
    two = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    assert call(odd, two, two, blocks, 4, 1.0, torch.empty_like(odd)) == 1  # 3 % 2


@needs_avx512_bf16
def test_avx512_prefill_declines_what_it_does_not_cover():
    assert_declines_what_no_vector_kernel_covers(_call_avx512)


@needs_avx512_bf16
def test_dispatch_reports_the_kernel_that_runs(each_prefill_form):
    amx = bool(_library().amx_available())
    form = ", float32 FMA" if each_prefill_form else ""
    assert native.prefill_attention_path(9, 3, 64) == ("AMX" if amx else "AVX-512 BF16" + form)
    assert native.prefill_attention_path(4, 2, 32) == "torch sdpa"
    query, k_cache, v_cache, blocks = _case(20, 90, 9, 3, 64, 16, seed=7)
    out = torch.empty(20, 9, 64, dtype=torch.bfloat16)
    assert native.prefill_attention(query, k_cache, v_cache, blocks, 90, 0.125, out)
    torch.testing.assert_close(out.float(), _expected(query, k_cache, v_cache, blocks, 90, 0.125),
                               atol=2e-2, rtol=2e-2)


def _head_dim_64_model(tmp_path: Path) -> str:
    """A tiny llama whose heads the kernel covers: 3 query heads on 1 kv head, head_dim 64."""
    from transformers import AutoModelForCausalLM

    from tiny_models import hf_config, tiny_tokenizer

    torch.manual_seed(0)
    config = hf_config("llama")
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 192, 3, 1
    config.head_dim, config.intermediate_size = 64, 256
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    return str(tmp_path)


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def shared_prefix_prompts() -> list[dict]:
    """Three prompts after one 100-token prefix (prefilled in chunks over their cached context)
    and one that is a 37-token slice of it (a prefix-cache hit)."""
    prefix = [(5 * t) % 200 + 3 for t in range(100)]
    return [{"prompt_token_ids": prefix + [(7 * t + s) % 200 + 3 for t in range(40 + 30 * s)]}
            for s in range(3)] + [{"prompt_token_ids": prefix[:37]}]


def assert_agree_up_to_near_ties(fast_runs, slow_runs) -> None:
    """Prompt logprobs within bf16 noise; greedy texts equal until the slow path's top two are
    within 0.05 (the random model's logits are nearly flat, and paths round differently)."""
    for fast, slow in zip(fast_runs, slow_runs):
        fast_prompt = [next(iter(p.values())).logprob for p in fast.prompt_logprobs[1:]]
        slow_prompt = [next(iter(p.values())).logprob for p in slow.prompt_logprobs[1:]]
        torch.testing.assert_close(torch.tensor(fast_prompt), torch.tensor(slow_prompt),
                                   atol=0.05, rtol=0.02)
        a, b = fast.outputs[0], slow.outputs[0]
        part = _first_divergence(a.token_ids, b.token_ids)
        if part < len(b.token_ids):  # only at a near tie of the fallback's top two
            top_two = sorted((lp.logprob for lp in b.logprobs[part].values()), reverse=True)[:2]
            assert top_two[0] - top_two[1] < 0.05, (part, a.token_ids, b.token_ids)


def assert_engine_matches_the_sdpa_fallback(tmp_path, monkeypatch, kernel: str,
                                            switched_off: tuple[str, ...] = ()) -> None:
    """A bf16 engine whose prefill runs the library entry `kernel` in place of the AMX one,
    which native.prefill_attention calls first (so the kernel runs on any CPU that has it; the
    entries named in `switched_off` decline), then with native prefill switched off (gather +
    SDPA): prompts prefilled in 48-token chunks over their cached context, sharing a prefix (a
    prefix-cache hit). The two agree up to near ties."""
    from pagedgen import LLM, SamplingParams

    model = _head_dim_64_model(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2,
                            prompt_logprobs=0)
    library = native.load()
    entry = getattr(library, kernel)
    calls = []

    def counted(*args):
        calls.append(entry(*args))
        return calls[-1]

    monkeypatch.setattr(library, "prefill_attention_bf16", counted)
    for name in switched_off:
        monkeypatch.setattr(library, name, lambda *args: 1)
    runs = {}
    for path in ("kernel", "sdpa"):
        if path == "sdpa":
            monkeypatch.setattr(native, "prefill_attention", lambda *args: False)
        llm = LLM(model, dtype="bfloat16", threads=1, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=48)
        runs[path] = llm.generate(shared_prefix_prompts(), params, use_tqdm=False)
    assert calls and all(status == 0 for status in calls)
    assert_agree_up_to_near_ties(runs["kernel"], runs["sdpa"])


@needs_avx512_bf16
def test_engine_greedy_outputs_match_the_sdpa_fallback(tmp_path, monkeypatch):
    # The random model's logits are nearly flat, so greedy texts may part where the top two
    # are within bf16 noise (both paths round differently); up to there they must agree, and
    # the prompt logprobs (every chunk's attention over its cached context) must agree within
    # bf16 noise.
    assert_engine_matches_the_sdpa_fallback(tmp_path, monkeypatch,
                                            "prefill_attention_avx512_bf16")
