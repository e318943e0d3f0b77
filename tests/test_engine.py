"""The engine end to end on a tiny random Llama (float32), with transformers as the oracle."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedgen import LLM, SamplingParams
from pagedgen.engine.engine import LLMEngine
from pagedgen.model.runtime.runner import ModelRunner
from pagedgen.settings import EngineConfig
from tiny_models import tiny_hf_model, tiny_loaded_model, tiny_model_dir

MIXED_PROMPTS = [list(range(10 + 7 * i, 10 + 7 * i + n)) for i, n in enumerate([3, 17, 40, 64, 9, 30])]
NEW_TOKENS = 24


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@functools.cache
def hf_greedy(prompt: tuple[int, ...], new_tokens: int = NEW_TOKENS) -> list[int]:
    out = tiny_hf_model().generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logits(token_ids: list[int]) -> torch.Tensor:
    """transformers' next-token logits after every position of token_ids."""
    return tiny_hf_model()(torch.tensor([token_ids])).logits[0].float()


def make_llm(**options) -> LLM:
    options.setdefault("num_blocks", 128)
    return LLM(str(tiny_model_dir()), dtype="float32", **options)


@functools.cache
def shared_llm() -> LLM:
    return make_llm()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# --- parity with transformers ---

def test_greedy_batch_of_mixed_lengths_equals_transformers():
    outputs = shared_llm().generate(MIXED_PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outputs) == [hf_greedy(tuple(p)) for p in MIXED_PROMPTS]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_greedy_equals_transformers_under_preemption():
    llm = make_llm(num_blocks=12)   # 192 slots for ~300 tokens of demand
    outputs = llm.generate(MIXED_PROMPTS, greedy(), use_tqdm=False)
    assert llm.engine.scheduler.stats.preemptions > 0
    assert llm.engine.scheduler.stats.recomputed_tokens > 0
    assert token_ids(outputs) == [hf_greedy(tuple(p)) for p in MIXED_PROMPTS]
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.snapshot().blocks_used == 0


def test_chunked_prefill_equals_unchunked():
    llm = make_llm(max_num_batched_tokens=8, max_num_seqs=8)
    outputs = llm.generate(MIXED_PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outputs) == [hf_greedy(tuple(p)) for p in MIXED_PROMPTS]
    assert llm.engine.stats.steps > 64 // 8   # the longest prompt alone took 8 steps


def test_prefix_caching_on_and_off_give_the_same_tokens_with_hits():
    prefix = list(range(300, 348))  # three full blocks shared by every prompt
    prompts = [prefix + [5 + i, 9, 2 * i + 1] for i in range(4)]
    cached, uncached = make_llm(), make_llm(enable_prefix_caching=False)
    with_cache = cached.generate(prompts, greedy(), use_tqdm=False)
    without = uncached.generate(prompts, greedy(), use_tqdm=False)
    assert token_ids(with_cache) == token_ids(without) == [hf_greedy(tuple(p)) for p in prompts]
    hits = [o.usage.cached_prompt_tokens for o in with_cache]
    assert sum(hits) >= 3 * 48 and hits[0] == 0
    assert all(o.usage.cached_prompt_tokens == 0 for o in without)
    assert cached.engine.scheduler.stats.prompt_tokens_computed == sum(map(len, prompts)) - sum(hits)


def test_logprobs_match_log_softmax_of_transformers_logits():
    prompt = MIXED_PROMPTS[1]
    out = shared_llm().generate([prompt], greedy(max_tokens=6, logprobs=3), use_tqdm=False)[0].outputs[0]
    reference = hf_logits(prompt + out.token_ids).log_softmax(-1)[len(prompt) - 1:-1]
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top = reference[position].topk(3)
        assert list(entry) == top.indices.tolist()  # the greedy token is the top one
        got = torch.tensor([entry[t].logprob for t in top.indices.tolist()])
        torch.testing.assert_close(got, top.values, atol=1e-4, rtol=0)
        assert [entry[t].rank for t in entry] == [1, 2, 3]
        assert entry[token].decoded_token is not None
    expected_sum = reference.gather(1, torch.tensor(out.token_ids)[:, None]).sum()
    assert abs(out.cumulative_logprob - float(expected_sum)) < 1e-3


def test_penalties_follow_a_hand_computation_on_transformers_logits():
    prompt = [40, 41, 42, 40, 41]
    params = greedy(max_tokens=8, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4)
    got = shared_llm().generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    tokens, expected = list(prompt), []
    for _ in range(8):
        logits = hf_logits(tokens)[-1]
        for t in set(tokens):
            logits[t] = logits[t] / 1.8 if logits[t] > 0 else logits[t] * 1.8
        for t in set(expected):
            logits[t] -= 0.7 * expected.count(t) + 0.4
        expected.append(int(logits.argmax()))
        tokens.append(expected[-1])
    assert got == expected
    assert got != hf_greedy(tuple(prompt), 8)  # the penalties did change something


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    target = MIXED_PROMPTS[2]
    alone = make_llm(seed=1).generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [[100 + i, 7, 8 + i] for i in range(16)]
    batch = [others[i] for i in range(8)] + [target] + others[8:]
    mixed_params = [SamplingParams(temperature=0.9, max_tokens=8 + i % 5, ignore_eos=True)
                    for i in range(8)] + [params] + [greedy(5)] * 8
    outputs = make_llm(seed=2).generate(batch, mixed_params, use_tqdm=False)
    assert outputs[8].outputs[0].token_ids == alone


# --- stopping ---

def test_max_tokens_and_the_model_length_clamp():
    llm = make_llm(max_model_len=48)
    prompt = MIXED_PROMPTS[2]   # 40 tokens: room for 8
    clamped, short = llm.generate([prompt, prompt], [greedy(100), greedy(5)], use_tqdm=False)
    assert len(clamped.outputs[0].token_ids) == 8 and clamped.outputs[0].finish_reason == "length"
    assert short.outputs[0].token_ids == hf_greedy(tuple(prompt))[:5]


def test_stop_string_split_across_tokens_cuts_the_text():
    llm, prompt = shared_llm(), MIXED_PROMPTS[3]   # its output has clean text pieces
    tokenizer = llm.get_tokenizer()
    full = llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0]
    stop, cut = _stop_string_across_a_boundary(tokenizer, full.token_ids)
    params = greedy(stop=[stop])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:cut]
    kept = llm.generate([prompt], greedy(stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:cut + len(stop)]


def _stop_string_across_a_boundary(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A 2-character string whose first occurrence straddles the boundary of tokens k-1, k."""
    full = tokenizer.decode(ids)
    for k in range(2, len(ids) - 1):
        head = tokenizer.decode(ids[:k])
        if not full.startswith(head):
            continue
        stop = full[len(head) - 1:len(head) + 1]
        if len(stop) == 2 and full.find(stop) == len(head) - 1 and stop.strip() and "\ufffd" not in stop:
            return stop, len(head) - 1
    pytest.fail("no usable token boundary in the generated text")


def test_min_tokens_masks_stop_tokens_until_reached():
    prompt = MIXED_PROMPTS[0]
    first = hf_greedy(tuple(prompt))[0]
    out = shared_llm().generate([prompt], greedy(max_tokens=6, min_tokens=3, stop_token_ids=[first]),
                                use_tqdm=False)[0].outputs[0]
    logits = hf_logits(prompt)[-1]
    logits[first] = float("-inf")
    assert out.token_ids[0] == int(logits.argmax())   # second choice, not a stop
    assert first not in out.token_ids[:3]
    assert len(out.token_ids) >= 3


def test_stop_token_id_ends_the_sequence():
    prompt = MIXED_PROMPTS[4]
    reference = hf_greedy(tuple(prompt))
    stop_token = reference[4]
    out = shared_llm().generate([prompt], greedy(stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    first = reference.index(stop_token)
    assert out.token_ids == reference[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token


def test_eos_stops_unless_ignore_eos():
    prompt = MIXED_PROMPTS[1]
    reference = hf_greedy(tuple(prompt))
    eos = reference[3]
    loaded = tiny_loaded_model()
    engine = LLMEngine(ModelRunner(loaded, EngineConfig(block_size=16, num_blocks=32)), loaded.tokenizer, [eos],
                       EngineConfig(max_model_len=512))
    engine.add_request("eos", prompt, SamplingParams(temperature=0, max_tokens=12))
    engine.add_request("ignore", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    results = {}
    while engine.has_unfinished():
        results.update({o.request_id: o.outputs[0] for o in engine.step()})
    stopped = results["eos"]
    assert stopped.token_ids == reference[:reference.index(eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert results["ignore"].token_ids == reference[:12] and results["ignore"].finish_reason == "length"


# --- requests that can never run ---

def test_a_request_that_can_never_fit_fails_alone():
    llm = make_llm(num_blocks=8, max_model_len=200)     # pool: 128 tokens
    too_long = list(range(1, 210))                       # > max_model_len
    too_big = list(range(1, 101))                        # 100 + 50 tokens > 8 blocks
    good = MIXED_PROMPTS[:2]
    seen = []
    outputs = llm.generate([good[0], too_long, too_big, good[1]],
                           [greedy(), greedy(), greedy(50), greedy()], use_tqdm=False,
                           on_output=seen.append)
    assert "prompt has 209 tokens but max_model_len is 200" in outputs[1].error
    assert "raise --max-model-len or shorten the prompt" in outputs[1].error
    assert "KV blocks" in outputs[2].error and outputs[2].outputs == []
    assert token_ids([outputs[0], outputs[3]]) == [hf_greedy(tuple(p)) for p in good]
    assert outputs[0].error is None and len(seen) == 4
