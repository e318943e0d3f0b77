"""n > 1 by fork: the prompt is computed once and its blocks are shared, zero copy.

n = 4, a 1,000-token prompt, 64 new tokens each, B = 16, prefix caching off. Each sample ends
holding 1,000 + 63 tokens (the last sampled token is never stored) = 67 blocks: 62 full prompt
blocks shared by all four, plus 5 private ones each (the copied-on-write partial prompt block
and 4 new ones). Physical peak 62 + 4 x 5 = 82 blocks, against 4 x 67 = 268 unshared (-69%).
"""

from __future__ import annotations

import pytest
import torch

from pagedgen import LLM, SamplingParams
from tiny_models import tiny_hf_model, tiny_model_dir

PROMPT_LEN, NEW_TOKENS, N = 1000, 64, 4


@pytest.fixture(scope="module")
def long_model_dir():
    """The tiny Llama of tiny_models.py, with room for 1,064 positions."""
    long = dict(max_position_embeddings=2048)
    return tiny_model_dir("llama", **long), tiny_hf_model("llama", **long)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()


def make_llm(folder) -> LLM:
    return LLM(str(folder), dtype="float32", block_size=16, num_blocks=300,
               enable_prefix_caching=False, seed=0)


def samples(output) -> list[list[int]]:
    return [c.token_ids for c in output.outputs]


def test_fork_computes_the_prompt_once_and_shares_its_blocks(long_model_dir, prompt):
    folder, hf_model = long_model_dir
    llm = make_llm(folder)
    params = SamplingParams(n=N, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.engine.scheduler.stats.prompt_tokens_computed == PROMPT_LEN  # not 4,000
    summary = llm.memory_report()["summary"]
    assert summary["peak_blocks_used"] == 82
    assert summary["logical_blocks_at_peak"] == 268
    assert 1 - 82 / 268 > 0.69
    assert summary["cow_copies"] == N - 1   # the last holder writes its partial block in place
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == N * NEW_TOKENS and out.usage.prompt_tokens == PROMPT_LEN

    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                          use_tqdm=False)[0]
    assert samples(out) == [single.outputs[0].token_ids] * N
    reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    assert single.outputs[0].token_ids == reference[0, PROMPT_LEN:].tolist()
    llm.engine.kv.check_integrity()


def test_seeded_samples_differ_from_each_other_and_repeat(long_model_dir, prompt):
    folder, _ = long_model_dir
    params = SamplingParams(n=N, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    short_prompt = prompt[:100]
    first = samples(make_llm(folder).generate([short_prompt], params, use_tqdm=False)[0])
    again = samples(make_llm(folder).generate([short_prompt], params, use_tqdm=False)[0])
    assert first == again
    assert len({tuple(s) for s in first}) == N


def test_forked_samples_survive_preemption_and_still_match_n_equals_1():
    prompt = list(range(50, 90))   # 40 tokens: 2 full shared blocks + a partial one
    llm = LLM(str(tiny_model_dir()), dtype="float32", num_blocks=9, seed=0)
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True)
    together = llm.generate([prompt, prompt[::-1]], [SamplingParams(n=3, **greedy), SamplingParams(**greedy)],
                            use_tqdm=False)
    assert llm.engine.scheduler.stats.preemptions > 0
    single = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0]
    assert samples(together[0]) == [single.outputs[0].token_ids] * 3
    assert llm.engine.kv.snapshot().blocks_used == 0
