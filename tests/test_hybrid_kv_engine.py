"""The engine on a hybrid KV cache (layer groups, sliding groups releasing blocks), end to end
against transformers: tiny random Gemma 3 (the 270M's layer pattern, scaled down) and Mistral
with a sliding window, greedy float32, prompts and outputs several windows long."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedgen import LLM, SamplingParams
from pagedgen.engine.beam_search import BeamSearchParams
from pagedgen.engine.engine import LLMEngine
from pagedgen.settings import EngineConfig
from pagedgen.model.loading.loader import load_model
from pagedgen.model.runtime.runner import ModelRunner
from tiny_models import _perturb_norms_and_biases, _workdir, tiny_tokenizer

WINDOW = 16
NEW_TOKENS = 40
# 12 layers, every 6th global, as Gemma 3 (270M: 18): G = 2, one full and five sliding groups.
GEMMA_TYPES = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                    for i in range(12))


def _config(arch: str):
    from transformers import Gemma3TextConfig, MistralConfig

    tok = tiny_tokenizer()
    ids = dict(vocab_size=len(tok), max_position_embeddings=512, pad_token_id=tok.pad_token_id,
               eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    if arch == "gemma3":
        return Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=12,
                                num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                sliding_window=WINDOW, layer_types=list(GEMMA_TYPES),
                                query_pre_attn_scalar=32, tie_word_embeddings=True,
                                initializer_range=0.1, **ids)
    return MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                         initializer_range=0.1, **ids)


@functools.cache
def model_dir(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    _perturb_norms_and_biases(model, 0)
    folder = _workdir() / f"hybrid-{arch}"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@functools.cache
def hf_model(arch: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir(arch), dtype=torch.float32,
                                                 attn_implementation="eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tiny_tokenizer().pad_token_id
    return model.eval()


@functools.cache
def hf_greedy(arch: str, prompt: tuple[int, ...], new_tokens: int = NEW_TOKENS) -> list[int]:
    out = hf_model(arch).generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                  do_sample=False)
    return out[0, len(prompt):].tolist()


PROMPTS = [list(range(20 + 3 * i, 20 + 3 * i + n)) for i, n in enumerate([5, 37, 70, 23])]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


def make_llm(arch: str, **options) -> LLM:
    options.setdefault("num_blocks", 400)
    options.setdefault("max_num_seqs", 8)
    return LLM(str(model_dir(arch)), dtype="float32", **options)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def check_released(llm: LLM) -> None:
    """The sliding groups did give blocks back, and the pool is whole and empty at the end."""
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.snapshot().blocks_used == 0
    assert kv.counters.window_released > 0


def test_gemma_layout_groups_layers_by_kind():
    llm = make_llm("gemma3")
    layout = llm.runner.kv_layout
    assert layout.group_size == 2 and layout.group_windows == (0,) + (WINDOW,) * 5
    assert layout.padding_slots == 0
    assert llm.runner.kv_cache.shape[:3] == (2, 2, 400)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gemma_greedy_equals_transformers_at_block_sizes(block_size):
    llm = make_llm("gemma3", block_size=block_size, max_num_batched_tokens=24)
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert ids(outputs) == [hf_greedy("gemma3", tuple(p)) for p in PROMPTS]
    check_released(llm)


def test_gemma_chunk_longer_than_the_window():
    llm = make_llm("gemma3", block_size=8, max_num_batched_tokens=64)  # chunks of 64 > W = 16
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert ids(outputs) == [hf_greedy("gemma3", tuple(p)) for p in PROMPTS]
    check_released(llm)


def test_gemma_under_preemption():
    llm = make_llm("gemma3", block_size=8, num_blocks=64, max_num_batched_tokens=32)
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert llm.engine.scheduler.stats.preemptions > 0
    assert ids(outputs) == [hf_greedy("gemma3", tuple(p)) for p in PROMPTS]
    check_released(llm)


def test_gemma_prefix_hits_need_only_the_window():
    llm = make_llm("gemma3", block_size=8, max_num_batched_tokens=32)
    shared = list(range(30, 100))  # ~4 windows of a common prefix, then different tails
    prompts = [shared + [5 + i, 7, 9] for i in range(3)]
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(), use_tqdm=False)
    assert ids(first + rest) == [hf_greedy("gemma3", tuple(p)) for p in prompts]
    assert all(o.usage.cached_prompt_tokens >= 64 for o in rest)  # type: ignore[attr-defined]
    check_released(llm)


def test_gemma_parallel_samples_share_blocks_with_copy_on_write():
    llm = make_llm("gemma3", block_size=8)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, seed=3)
    outputs = llm.generate([PROMPTS[2]], params, use_tqdm=False)
    assert len(outputs[0].outputs) == 4
    assert llm.engine.kv.counters.cow_copies > 0
    check_released(llm)
    # The n=4 samples are each what the same seeded sample gives alone (n=1 per seed path).
    greedy_n = SamplingParams(n=4, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([PROMPTS[2]], greedy_n, use_tqdm=False)[0]
    assert all(c.token_ids == hf_greedy("gemma3", tuple(PROMPTS[2])) for c in out.outputs)


def test_gemma_beam_search_equals_transformers():
    llm = make_llm("gemma3", block_size=8)
    prompt = PROMPTS[1]
    result = llm.beam_search([{"prompt_token_ids": prompt}],
                             BeamSearchParams(beam_width=3, max_tokens=24, ignore_eos=True),
                             use_tqdm=False)[0]
    hf = hf_model("gemma3").generate(torch.tensor([prompt]), max_new_tokens=24, num_beams=3,
                                     num_return_sequences=3, do_sample=False,
                                     early_stopping=True, length_penalty=1.0)
    expected = [row[len(prompt):].tolist() for row in hf]
    got = [b.output_token_ids for b in result.sequences]
    assert got[0] == expected[0]
    check_released(llm)


def test_mistral_past_its_window_equals_transformers():
    llm = make_llm("mistral", block_size=8, max_num_batched_tokens=24)
    assert llm.runner.kv_layout.group_windows == (WINDOW,)
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert ids(outputs) == [hf_greedy("mistral", tuple(p)) for p in PROMPTS]
    check_released(llm)


def engine_outputs(hybrid: bool, prompts, dtype=torch.float32,
                   **runner_options) -> tuple[list[list[int]], LLMEngine]:
    """Greedy tokens of an engine on a hybrid pool or on one group keeping every token."""
    loaded = load_model(str(model_dir("gemma3")), dtype=dtype, device="cpu")
    config = EngineConfig(block_size=8, num_blocks=400, max_num_seqs=8,
                          max_num_batched_tokens=24, max_model_len=512, **runner_options)
    runner = ModelRunner(loaded, config, hybrid_kv=hybrid)
    engine = LLMEngine(runner, None, [], config)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy())
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    return [done[str(i)] for i in range(len(prompts))], engine


def test_gemma_8bit_kv_hybrid_equals_one_group_pool():
    """Released blocks change nothing a window reads: 8-bit codes and scales per block are the
    same in both layouts, so the tokens are identical."""
    hybrid, engine = engine_outputs(True, PROMPTS, kv_cache_dtype="int8")
    single, _ = engine_outputs(False, PROMPTS, kv_cache_dtype="int8")
    assert engine.runner.kv_scales.shape[:2] == (2, 2)  # [G, 2, N, H_kv]
    assert hybrid == single
    engine.kv.check_integrity()
    assert engine.kv.counters.window_released > 0


def test_gemma_bf16_native_kernels_hybrid_equals_one_group_pool():
    """bf16 runs the native CPU kernels: through tables with released entries they must read
    exactly what they read in a pool that keeps every block (same tokens, bit for bit)."""
    hybrid, engine = engine_outputs(True, PROMPTS, dtype=torch.bfloat16)
    single, _ = engine_outputs(False, PROMPTS, dtype=torch.bfloat16)
    assert hybrid == single
    assert engine.kv.counters.window_released > 0


def test_gemma_batch_invariant_mode_equals_transformers():
    llm = make_llm("gemma3", block_size=8, batch_invariant=True)
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert ids(outputs) == [hf_greedy("gemma3", tuple(p)) for p in PROMPTS]
    check_released(llm)


def test_memory_report_shows_each_group_and_the_full_attention_row():
    from pagedgen.memory.render import report_renderable
    from pagedgen.memory.report import build_report
    from rich.console import Console

    llm = make_llm("gemma3", block_size=8, max_num_batched_tokens=24)
    llm.generate(PROMPTS, greedy(), use_tqdm=False)
    report = build_report(llm.tracker, llm.engine.kv.counters)
    section = report["kv_groups"]
    groups = section["groups"]
    assert [g["window"] for g in groups] == [0] + [WINDOW] * 5
    assert [g["layers"] for g in groups] == [2] * 6
    assert groups[0]["blocks_released_by_window"] == 0
    assert all(g["blocks_released_by_window"] > 0 for g in groups[1:])
    # The full group holds every block; a sliding group only its windows at the peak.
    assert all(g["blocks_used_at_peak"] < groups[0]["blocks_used_at_peak"] for g in groups[1:])
    assert sum(g["blocks_used_at_peak"] for g in groups) == report["summary"]["peak_blocks_used"]
    assert section["peak_bytes"] < section["full_attention"]["peak_bytes"]
    console = Console(width=160, record=True)
    console.print(report_renderable(report))
    text = console.export_text()
    assert "every layer full attention" in text and "freed by the window" in text


def test_ci_memory_targets_on_the_270m_shape_scaled_down():
    """bench/bench_hybrid_kv.py at 1/16 scale (window 32, 512-token sequences, the 270M's layer
    pattern and KV shape): peak KV bytes of 16 sequences <= 0.25 x a full-attention pool's, and
    at the same budget >= 3.5 x as many sequences run at once without a preemption."""
    import math
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_hybrid_kv import Shape, _runs_clean, most_without_preempting, peak_ratio

    shape = Shape().scaled(16)
    assert peak_ratio(shape)["ratio"] <= 0.25
    budget = 2**30 // 16
    full = most_without_preempting(shape, False, budget)
    assert full >= 1
    assert _runs_clean(shape, True, budget, math.ceil(3.5 * full))
