"""Prompt logprobs equal log_softmax of transformers' forward logits (float32, same weights)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from pagedgen import LLM, SamplingParams
from pagedgen.engine import prompt_logprobs
from tiny_models import tiny_hf_model, tiny_model_dir

TOP = 3
PROMPT = torch.randint(3, 512, (45,), generator=torch.Generator().manual_seed(7)).tolist()


@functools.cache
def hf_logprobs(prompt: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        logits = tiny_hf_model()(torch.tensor([list(prompt)])).logits[0].float()
    return logits.log_softmax(dim=-1)


def make_llm(**options) -> LLM:
    return LLM(str(tiny_model_dir()), **{"dtype": "float32", "num_blocks": 128, **options})


def params(**extra) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 2, "prompt_logprobs": TOP, **extra})


def assert_matches_transformers(positions, prompt: list[int]) -> None:
    reference = hf_logprobs(tuple(prompt))
    assert len(positions) == len(prompt) and positions[0] is None
    for p in range(1, len(prompt)):
        row, entry, actual = reference[p - 1], positions[p], prompt[p]
        assert math.isclose(entry[actual].logprob, float(row[actual]), abs_tol=1e-4)
        assert entry[actual].rank == int((row > row[actual]).sum()) + 1
        top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= TOP)
        assert [r for r, _ in top] == [1, 2, 3]
        for rank, token in top:
            assert math.isclose(entry[token].logprob, float(row.topk(TOP).values[rank - 1]),
                                abs_tol=1e-4)
        assert set(entry) == {t for _, t in top} | {actual}
        assert entry[actual].decoded_token is not None


def test_prompt_logprobs_equal_transformers():
    output = make_llm().generate([PROMPT], params(), use_tqdm=False)[0]
    assert_matches_transformers(output.prompt_logprobs, PROMPT)
    assert output.outputs[0].logprobs is None     # only what was asked for


def test_a_warm_prefix_cache_is_skipped_for_them():
    llm = make_llm()
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)        # warms the cache
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    scored = llm.generate([PROMPT], params(), use_tqdm=False)[0]
    assert plain.usage.cached_prompt_tokens > 0
    assert scored.usage.cached_prompt_tokens == 0
    assert_matches_transformers(scored.prompt_logprobs, PROMPT)


def test_across_a_chunked_prefill_and_in_small_slices(monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_SLICE", 5)
    llm = make_llm(max_num_batched_tokens=8, max_num_seqs=4)
    prompts = [PROMPT, PROMPT[:17], PROMPT[5:30]]
    outputs = llm.generate(prompts, [params(), params(n=2, temperature=1.0), params()],
                           use_tqdm=False)
    for output, prompt in zip(outputs, prompts):
        assert_matches_transformers(output.prompt_logprobs, prompt)
    assert llm.engine.stats.steps > len(PROMPT) // 8


def test_a_preempted_request_scores_each_position_once():
    llm = make_llm(num_blocks=10, block_size=8)
    prompts = [PROMPT[:30], PROMPT[10:40], PROMPT[3:33]]
    outputs = llm.generate(prompts, params(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.stats.preemptions > 0
    for output, prompt in zip(outputs, prompts):
        assert_matches_transformers(output.prompt_logprobs, prompt)


def test_a_one_token_prompt_has_only_the_none_entry_and_to_dict_is_json_ready():
    output = make_llm().generate([[PROMPT[0]]], params(), use_tqdm=False)[0]
    assert output.prompt_logprobs == [None]
    scored = make_llm().generate([PROMPT[:3]], params(), use_tqdm=False)[0].to_dict()
    assert scored["prompt_logprobs"][0] is None
    assert all(isinstance(k, str) for k in scored["prompt_logprobs"][1])


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_values_are_rejected(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
