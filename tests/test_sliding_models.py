"""Sliding-window models (Gemma 3, Mistral, Qwen2) against transformers, on contexts several
windows long: greedy tokens, chunked prefill, and the engine's features (preemption, n > 1
forks, prefix hits, beam search). Tiny random models from tiny_models (windows 16-32 tokens).
"""
from __future__ import annotations

import functools

import pytest
import torch

from pagedgen import LLM, BeamSearchParams, SamplingParams
from pagedgen.model.runtime.kv_groups import layout_for, pages_for_tokens
from test_model_parity import pagedgen_greedy, random_prompts, run_chunks, transformers_greedy
from tiny_models import (SLIDING_ARCHITECTURES, WINDOWS, tiny_hf_model, tiny_loaded_model,
                         tiny_model_dir)

NEW_TOKENS = 40  # past the longest window several times over, prompt included


def lengths(arch: str) -> list[int]:
    """A prompt inside the window, one just past it, one several windows long."""
    window = WINDOWS[arch]
    return [5, window + 1, 3 * window + 7]


@functools.cache
def reference(arch: str) -> tuple:
    prompts = random_prompts(lengths(arch), tiny_loaded_model(arch).config.vocab_size, seed=11)
    return prompts, transformers_greedy(tiny_hf_model(arch), prompts, NEW_TOKENS)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES)
def test_greedy_tokens_equal_transformers_past_the_window(arch, block_size):
    prompts, expected = reference(arch)
    assert pagedgen_greedy(tiny_loaded_model(arch), prompts, NEW_TOKENS, block_size) == expected


@pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES)
def test_the_window_changes_the_tokens(arch):
    """The oracle sees the window: the same model attending to everything answers otherwise
    (so the tests above could fail if the window were ignored)."""
    prompts, expected = reference(arch)
    loaded = tiny_loaded_model(arch)
    attentions = [layer.attention for layer in loaded.model.layers]
    windows = [a.window for a in attentions]
    try:
        for attention in attentions:
            attention.window = 0
        assert pagedgen_greedy(loaded, prompts, NEW_TOKENS, 16) != expected
    finally:
        for attention, window in zip(attentions, windows):
            attention.window = window


@pytest.mark.parametrize("arch", ["gemma3", "gemma3_hd256", "mistral_window"])
def test_chunked_prefill_with_chunks_longer_and_shorter_than_the_window(arch):
    loaded = tiny_loaded_model(arch)
    window = WINDOWS[arch]
    total = 3 * window + 5
    prompt = random_prompts([total], loaded.config.vocab_size, seed=5)[0]
    cuts = [3, 3 + window + 9, 3 + window + 14, total]  # long, short, then the rest
    chunked = run_chunks(loaded, prompt, cuts)
    with torch.no_grad():
        hf_logits = tiny_hf_model(arch)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(chunked, hf_logits[[c - 1 for c in cuts]], atol=1e-4, rtol=1e-4)


# --- the engine end to end ------------------------------------------------------------------

GREEDY = dict(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_llm(arch: str, **options) -> LLM:
    options.setdefault("num_blocks", 256)
    options.setdefault("block_size", 8)
    return LLM(str(tiny_model_dir(arch)), dtype="float32", threads=1, seed=0, **options)


def engine_prompts(arch: str) -> list[list[int]]:
    window = WINDOWS[arch]
    return random_prompts([3, window - 1, 2 * window + 3, 4 * window], 500, seed=3)


@functools.cache
def hf_greedy(arch: str, prompt: tuple[int, ...]) -> list[int]:
    return transformers_greedy(tiny_hf_model(arch), [list(prompt)], NEW_TOKENS)[0]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def tight_pool(arch: str, prompts: list[list[int]], chunk: int) -> int:
    """A pool (in pages of the hybrid layout) where the longest sequence fits alone, with two
    pages to spare, but the four together do not: preemptions are certain."""
    layout = layout_for(tiny_loaded_model(arch).config)
    longest = max(map(len, prompts)) + NEW_TOKENS
    return pages_for_tokens(layout.group_windows, longest, 8, chunk) + 2


@pytest.mark.parametrize("arch", ["gemma3", "mistral_window"])
def test_engine_under_preemption_and_chunked_prefill_equals_transformers(arch):
    prompts = engine_prompts(arch)
    expected = [hf_greedy(arch, tuple(p)) for p in prompts]
    pressed = make_llm(arch, num_blocks=tight_pool(arch, prompts, 16),
                       max_num_batched_tokens=16, max_num_seqs=4)
    assert token_ids(pressed.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)) == expected
    assert pressed.engine.scheduler.stats.preemptions > 0
    pressed.engine.kv.check_integrity()
    assert pressed.engine.kv.snapshot().blocks_used == 0


def test_gemma_n4_forks_and_prefix_hits_equal_transformers():
    arch = "gemma3"
    window = WINDOWS[arch]
    shared = random_prompts([4 * window], 500, seed=8)[0]  # four windows, all full blocks (B = 8)
    first, second = shared + [7, 8, 9], shared + [30, 31]
    llm = make_llm(arch, enable_prefix_caching=True)
    forked = llm.generate([first], SamplingParams(n=4, **GREEDY), use_tqdm=False)[0]
    assert [c.token_ids for c in forked.outputs] == [hf_greedy(arch, tuple(first))] * 4
    hit = llm.generate([second], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert llm.memory_report()["summary"]["prefix_cache_hit_tokens"] >= len(shared)
    assert hit.outputs[0].token_ids == hf_greedy(arch, tuple(second))
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize("arch", ["gemma3", "mistral_window"])
def test_beam_search_equals_transformers_past_the_window(arch):
    width, max_tokens = 4, 24
    prompt = random_prompts([WINDOWS[arch] + 5], 500, seed=4)[0]
    out = tiny_hf_model(arch).generate(
        torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
        max_new_tokens=max_tokens, length_penalty=1.0, eos_token_id=None, pad_token_id=0,
        return_dict_in_generate=True, output_scores=True)
    expected = out.sequences[:, len(prompt):].tolist()
    llm = make_llm(arch)
    params = BeamSearchParams(width, max_tokens, ignore_eos=True, length_penalty=1.0)
    got = llm.beam_search([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].sequences
    assert [b.output_token_ids for b in got] == expected
    for beam, score in zip(got, out.sequences_scores.tolist()):
        assert beam.score == pytest.approx(score, abs=1e-4)
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize("arch", ["gemma3", "gemma3_hd256"])
def test_bfloat16_logits_follow_transformers_bfloat16(arch):
    """In bfloat16 (native kernels, head_dim 256 included, windows past the prompt's start)
    pagedgen stays far closer to transformers' bf16 model than bf16 is to float32: the
    roundings are the same kind (norms in float32, the embedding factor rounded to bf16)."""
    from transformers import AutoModelForCausalLM

    from pagedgen.model.loading.loader import load_model

    folder = tiny_model_dir(arch)
    loaded = load_model(str(folder), dtype=torch.bfloat16)
    prompt = random_prompts([5 * WINDOWS[arch]], loaded.config.vocab_size, seed=5)[0]
    cuts = [2 * WINDOWS[arch] + 3, len(prompt)]
    ours = run_chunks(loaded, prompt, cuts, block_size=16)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = hf_bf16(torch.tensor([prompt])).logits[0].float()[[c - 1 for c in cuts]]
        exact = tiny_hf_model(arch)(torch.tensor([prompt])).logits[0][[c - 1 for c in cuts]]
    assert (ours - theirs).abs().max() < 0.5 * (theirs - exact).abs().max()
