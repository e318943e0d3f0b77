"""A quantized pool under the engine: copy-on-write, prefix hits and preemption give the same
greedy tokens as runs without them (tiny model, float32 weights, 8-bit KV)."""
from __future__ import annotations

import pytest

from pagedgen import LLM, SamplingParams
from tiny_models import tiny_model_dir

GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


def make_llm(kv_cache_dtype: str, **options) -> LLM:
    options = {"num_blocks": 64, "enable_prefix_caching": False, **options}
    return LLM(str(tiny_model_dir()), dtype="float32", block_size=16, seed=0, threads=1,
               kv_cache_dtype=kv_cache_dtype, **options)


def tokens(output) -> list[list[int]]:
    return [c.token_ids for c in output.outputs]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_forked_samples_copy_codes_and_scales_and_match_n_equals_1(kv_cache_dtype):
    prompt = list(range(50, 90))  # 40 tokens: 2 full shared blocks + a partial one to copy
    llm = make_llm(kv_cache_dtype)
    forked = llm.generate([prompt], SamplingParams(n=3, **GREEDY), use_tqdm=False)[0]
    assert llm.memory_report()["summary"]["cow_copies"] == 2
    single = make_llm(kv_cache_dtype).generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert tokens(forked) == tokens(single) * 3


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e5m2"])
def test_prefix_hits_on_quantized_blocks_match_a_cold_run(kv_cache_dtype):
    shared = list(range(100, 148))  # three full blocks
    first, second = shared + [7, 8, 9], shared + [30, 31, 32, 33]
    warm = make_llm(kv_cache_dtype, enable_prefix_caching=True)
    warm.generate([first], SamplingParams(**GREEDY), use_tqdm=False)
    hit = warm.generate([second], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert warm.memory_report()["summary"]["prefix_cache_hit_tokens"] == 48
    cold = make_llm(kv_cache_dtype).generate([second], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert tokens(hit) == tokens(cold)


def test_preempted_sequences_on_an_int8_pool_match_an_unpressed_run():
    prompts = [list(range(50, 90)), list(range(200, 160, -1))]
    params = SamplingParams(**{**GREEDY, "max_tokens": 40})
    pressed = make_llm("int8", num_blocks=7)
    together = pressed.generate(prompts, params, use_tqdm=False)
    assert pressed.engine.scheduler.stats.preemptions > 0
    roomy = make_llm("int8").generate(prompts, params, use_tqdm=False)
    assert [tokens(o) for o in together] == [tokens(o) for o in roomy]
    assert pressed.engine.kv.snapshot().blocks_used == 0


def test_int8_pool_holds_about_twice_the_blocks_of_float32_halved():
    """The same byte budget: 1-byte codes + scales against bf16's 2 bytes per element."""
    budget = 1 << 20
    bf16 = LLM(str(tiny_model_dir()), dtype="bfloat16", kv_memory=budget, threads=1)
    int8 = LLM(str(tiny_model_dir()), dtype="bfloat16", kv_memory=budget, threads=1,
               kv_cache_dtype="int8")
    ratio = int8.runner.num_blocks / bf16.runner.num_blocks
    assert 1.9 <= ratio < 2.0
    assert int8.runner.kv_cache_bytes <= budget
    pool = int8.memory_report()["pool"]
    assert pool["kv_cache_dtype"] == "int8" and pool["layout"]["dtype_bytes"] == 1
