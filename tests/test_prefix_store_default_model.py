"""The prefix store on the default model (SmolLM2-135M-Instruct GGUF): in batch-invariant
bfloat16 mode a warm store changes no bit of the output — tokens and logprobs — with chunked
prefill, n > 1, prefix hits in memory and in the store, and preemption mixed in."""

from __future__ import annotations

import random

import pytest

from pagedgen import LLM, SamplingParams
from pagedgen.model.loading import default_model

pytestmark = pytest.mark.slow


def default_path() -> str:
    try:
        return str(default_model.default_model_path())
    except Exception as error:  # noqa: BLE001 - the message says how to install it
        pytest.fail(f"the default model is required here: {error}")


def prompts() -> list[dict]:
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(70)]
    items = [shared + [rng.randrange(100, 40000) for _ in range(rng.randrange(5, 60))] for _ in range(4)]
    items += [[rng.randrange(100, 40000) for _ in range(rng.randrange(100, 180))] for _ in range(3)]
    return [{"prompt_token_ids": p} for p in items]


def params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=5, ignore_eos=True,
                             logprobs=2)
    return [greedy, sampled] * 3 + [greedy]


def run(store) -> tuple[list, LLM]:
    # 18 blocks of 16 tokens: less than the batch wants, so sequences are preempted.
    llm = LLM(default_path(), dtype="bfloat16", batch_invariant=True, num_blocks=18,
              block_size=16, threads=2, max_num_seqs=4, max_num_batched_tokens=48,
              prefix_store=store)
    outputs = llm.generate(prompts(), params(), use_tqdm=False)
    return [[(c.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs])
             for c in o.outputs] for o in outputs], llm


def test_the_default_model_in_batch_invariant_bf16_is_bit_identical_with_a_warm_store(tmp_path):
    off, _ = run(None)
    cold, cold_llm = run(tmp_path / "store")
    assert cold_llm.engine.scheduler.stats.preemptions > 0
    assert cold_llm.engine.kv.counters.prefix_hit_tokens > 0          # memory hits
    warm, warm_llm = run(tmp_path / "store")
    assert warm_llm.memory_report()["prefix_store"]["hit_blocks"] > 0  # store hits
    assert off == cold == warm                                         # tokens and logprobs
