"""SamplingParams validation and the vectorized Sampler on plain logits tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from pagedgen.engine.sampler import Sampler, apply_penalties, build_batch
from pagedgen.engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams


@dataclass
class Row:
    """A stand-in for an engine sequence: just what the sampler reads."""

    params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    prompt_len: int = 3
    generator: torch.Generator | None = None
    banned: list[int] = field(default_factory=list)

    def banned_token_ids(self) -> list[int]:
        return self.banned


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, rows: list[Row], engine_seed: int = 0):
    batch = build_batch(rows, logits.shape[-1], "cpu")
    return Sampler(seeded(engine_seed))(logits, batch)


# --- SamplingParams ---

def test_defaults_are_documented_and_not_vllms_16():
    params = SamplingParams()
    assert params.max_tokens == DEFAULT_MAX_TOKENS == 256
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, 0)


@pytest.mark.parametrize("field_name, value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("seed", -1), ("max_tokens", 0),
    ("min_tokens", -1), ("logprobs", -1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0.0), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("ignore_eos", "yes"), ("n", True),
])
def test_invalid_values_raise_naming_the_field(field_name, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field_name}\b"):
        SamplingParams(**{field_name: value})


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_normalizes_stop_and_vllm_top_k_spelling():
    params = SamplingParams(stop="###", top_k=-1)
    assert params.stop == ["###"] and params.top_k == 0
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []


# --- Sampler ---

def test_greedy_rows_take_the_argmax_and_report_raw_logprobs():
    logits = torch.randn(5, 50, generator=seeded(1))
    out = sample(logits, [Row(SamplingParams(temperature=0, logprobs=0))] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = logits.log_softmax(-1).max(-1).values
    torch.testing.assert_close(torch.tensor(out.logprobs), expected)
    assert sample(logits, [Row(SamplingParams(temperature=0))] * 5).logprobs is None


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    # prompt = [0, 4]; output = [3, 3, 2]
    row = Row(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              token_ids=[0, 4, 3, 3, 2], prompt_len=2)
    batch = build_batch([row], 5, "cpu")
    got = apply_penalties(logits.clone(), batch.penalties)
    expected = torch.tensor([[
        2.0 / 2,                      # in the prompt, positive: divided
        -1.0,                         # never seen
        0.5 / 2 - 0.5 * 1 - 0.25,     # output once
        3.0 / 2 - 0.5 * 2 - 0.25,     # output twice
        -2.0 * 2,                     # in the prompt, negative: multiplied
    ]])
    torch.testing.assert_close(got, expected)


def test_rows_without_penalties_are_untouched_when_others_use_them():
    logits = torch.randn(2, 8, generator=seeded(2))
    rows = [Row(SamplingParams(temperature=0)),
            Row(SamplingParams(temperature=0, presence_penalty=2.0), token_ids=[1, 2, 3, 7], prompt_len=3)]
    out = sample(logits, rows)
    assert out.token_ids[0] == int(logits[0].argmax())
    penalized = logits[1].clone()
    penalized[7] -= 2.0
    assert out.token_ids[1] == int(penalized.argmax())


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(1, 6)
    logits[0, 4] = 10.0
    out = sample(logits, [Row(SamplingParams(temperature=0), banned=[4])])
    assert out.token_ids[0] != 4


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 20000
    logits = probs.log().expand(rows, 4).contiguous()
    out = sample(logits, [Row(SamplingParams(temperature=1.0))] * rows, engine_seed=3)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / rows
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([1.0, 0.0]).log_softmax(-1).expand(10000, 2).contiguous()
    out = sample(logits, [Row(SamplingParams(temperature=0.5))] * 10000, engine_seed=4)
    p = torch.tensor([1.0, 0.0]).div(0.5).softmax(-1)[0]
    assert abs(out.token_ids.count(0) / 10000 - float(p)) < 0.02


def test_top_k_top_p_and_min_p_cut_the_tail_among_candidates():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(3000, 4).contiguous()
    cases = {"top_k": (SamplingParams(top_k=2), {0, 1}),
             "top_p": (SamplingParams(top_p=0.65), {0, 1}),
             "min_p": (SamplingParams(min_p=0.6), {0, 1}),
             "top_k+top_p": (SamplingParams(top_k=3, top_p=0.5), {0, 1})}
    for name, (params, allowed) in cases.items():
        seen = set(sample(logits, [Row(params)] * 3000, engine_seed=5).token_ids)
        assert seen == allowed, name


def test_mixed_top_k_rows_keep_their_own_cut():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().expand(2000, 4).contiguous()
    rows = [Row(SamplingParams(top_k=1)), Row(SamplingParams())] * 1000
    out = sample(logits, rows, engine_seed=6)
    assert set(out.token_ids[0::2]) == {0}
    assert set(out.token_ids[1::2]) == {0, 1, 2, 3}


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    vocab = 100
    logits = torch.randn(17, vocab, generator=seeded(7))
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits[:1], [Row(params, generator=seeded(42))]).token_ids[0]]
    mixed_rows = [Row(params, generator=seeded(42))] + [Row(SamplingParams(temperature=0.8))] * 16
    in_batch = sample(logits, mixed_rows, engine_seed=99).token_ids[0]
    assert alone[0] == in_batch


def test_logprobs_top_k_and_rank_of_the_sampled_token():
    logits = torch.randn(3, 30, generator=seeded(8))
    rows = [Row(SamplingParams(temperature=0, logprobs=3)), Row(SamplingParams(temperature=0)),
            Row(SamplingParams(temperature=0, logprobs=5))]
    out = sample(logits, rows)
    reference = logits.log_softmax(-1)
    top = reference[[0, 2]].topk(5)
    torch.testing.assert_close(torch.tensor(out.top_logprobs), top.values)
    assert out.top_ids == top.indices.tolist()
    assert out.ranks == [1, 1]  # greedy tokens are the most likely
    torch.testing.assert_close(torch.tensor(out.logprobs), top.values[:, 0])


def test_top_logprobs_put_the_chosen_token_first_among_exact_ties():
    # bf16 logits tie exactly and topk orders equal values as it likes; the top list must still
    # open with the token the sampler chose (argmax's for greedy rows), then lower ids first.
    logits = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0, 3.0]).bfloat16().expand(41, 6).contiguous()
    rows = [Row(SamplingParams(temperature=0, logprobs=2))] + \
        [Row(SamplingParams(temperature=1.0, logprobs=k)) for k in (1, 2, 5, 6) for _ in range(10)]
    out = sample(logits, rows, engine_seed=3)
    assert out.token_ids[0] == 1                      # argmax: the first maximal index
    assert len(set(out.token_ids[1:]) & {1, 2, 3, 5}) > 2   # draws land on several tied tokens
    reference = logits[0].float().log_softmax(-1).tolist()
    for token, rank, ids, values in zip(out.token_ids, out.ranks, out.top_ids, out.top_logprobs):
        expected = sorted(range(6), key=lambda t: (-reference[t], t != token, t))
        assert ids == expected and rank == expected.index(token) + 1
        torch.testing.assert_close(values, [reference[t] for t in ids])


def test_greedy_token_heads_the_top_list_on_a_wide_bf16_vocab():
    logits = torch.randn(3, 49152, generator=seeded(5)).bfloat16()
    logits[:, [40000, 7, 20000]] = 9.0               # three exact maxima per row
    logits[1, 7] = -9.0                              # row 1: argmax is 20000
    out = sample(logits, [Row(SamplingParams(temperature=0, logprobs=k)) for k in (1, 2, 3)])
    assert out.token_ids == [7, 20000, 7] and out.ranks == [1, 1, 1]
    assert out.top_ids[0] == out.top_ids[2] == [7, 20000, 40000]
    assert out.top_ids[1][:2] == [20000, 40000]


def test_rank_of_a_sampled_unlikely_token():
    logits = torch.tensor([[5.0, 4.0, 3.0, -50.0]])
    out = sample(logits, [Row(SamplingParams(logprobs=1), banned=[0, 1])])
    assert out.token_ids == [2] and out.ranks == [3]


# --- wide vocabularies: the candidate shortcut must agree with the full-vocabulary filters ---

def reference_support(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens with non-zero probability under vLLM's sort-based filters (one row)."""
    from pagedgen.engine.sampler import apply_min_p, apply_top_k_top_p

    scaled = logits[None] / params.temperature
    scaled = apply_min_p(scaled, torch.tensor([params.min_p]))
    scaled = apply_top_k_top_p(scaled, torch.tensor([params.top_k]), torch.tensor([params.top_p]))
    return set(torch.isfinite(scaled[0]).nonzero().squeeze(1).tolist())


@pytest.mark.parametrize("params, peaked", [
    (SamplingParams(top_p=0.9), True),            # nucleus closes among the candidates
    (SamplingParams(top_p=0.5), False),           # ~500 tokens: full-vocabulary fallback
    (SamplingParams(top_p=0.9, min_p=0.2), True),
    (SamplingParams(min_p=0.9, temperature=0.5), False),
    (SamplingParams(top_k=300, top_p=0.7), False),
])
def test_wide_vocab_draws_stay_inside_the_reference_support(params, peaked):
    vocab = 1000
    logits = 0.05 * torch.randn(vocab, generator=seeded(11))
    if peaked:
        logits[:12] += 9.0   # ~99% of the mass on 12 tokens
    support = reference_support(logits, params)
    rows = 3000
    out = sample(logits.expand(rows, vocab).contiguous(), [Row(params)] * rows, engine_seed=12)
    drawn = set(out.token_ids)
    assert drawn <= support
    assert len(drawn) > 0.8 * len(support) or len(support) <= 12


def test_plain_temperature_sampling_on_a_wide_vocab():
    vocab = 1000
    logits = torch.full((vocab,), -5.0)
    logits[7], logits[900] = 2.0, 1.0
    probs = logits.softmax(-1)
    rows = 8000
    out = sample(logits.expand(rows, vocab).contiguous(), [Row(SamplingParams())] * rows, engine_seed=13)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).float() / rows
    assert abs(counts[7] - probs[7]) < 0.02 and abs(counts[900] - probs[900]) < 0.02


# --- the full-vocabulary draw: same uniform numbers, same tokens as the plain formulation ---

def plain_inverse_cdf(logits: torch.Tensor, temperature: torch.Tensor,
                      uniforms: torch.Tensor) -> torch.Tensor:
    """The draw written without short cuts: always divide, always compute the fallback."""
    scaled = logits / temperature[:, None]
    weights = (scaled - scaled.max(dim=-1, keepdim=True).values).exp()
    cumulative = weights.cumsum(dim=-1)
    index = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None], right=True)
    index = index.clamp_max(weights.shape[-1] - 1)
    landed_on_zero = weights.gather(1, index) <= 0
    return torch.where(landed_on_zero, weights.argmax(dim=-1, keepdim=True), index).squeeze(1)


@pytest.mark.parametrize("temperature, vocab", [(1.0, 49152), (0.7, 49152), (1.0, 50257),
                                                (1.3, 50257)])
def test_seeded_full_vocab_draws_equal_the_plain_formulation(temperature, vocab):
    rows = 21
    logits = 3.0 * torch.randn(rows, vocab, generator=seeded(21))
    logits[:4, 100:] = float("-inf")                  # rows whose tail has zero weight
    seeds = [1000 + i for i in range(rows)]
    batch_rows = [Row(SamplingParams(temperature=temperature, seed=s), generator=seeded(s))
                  for s in seeds]
    tokens = sample(logits, batch_rows).token_ids
    uniforms = torch.cat([torch.rand(1, generator=seeded(s)) for s in seeds])
    expected = plain_inverse_cdf(logits, torch.full((rows,), temperature), uniforms)
    assert tokens == expected.tolist()


def test_unseeded_and_seeded_rows_draw_the_engine_stream_then_their_own():
    rows, vocab = 9, 5000
    logits = torch.randn(rows, vocab, generator=seeded(22))
    temperatures = torch.tensor([1.0, 0.5, 1.0, 2.0, 1.0, 1.0, 0.9, 1.0, 1.0])
    seeded_at = {2: 77, 5: 78}
    batch_rows = [Row(SamplingParams(temperature=float(t), seed=seeded_at.get(i)),
                      generator=seeded(seeded_at[i]) if i in seeded_at else None)
                  for i, t in enumerate(temperatures)]
    tokens = sample(logits, batch_rows, engine_seed=5).token_ids
    uniforms = torch.rand(rows, generator=seeded(5))
    for i, s in seeded_at.items():
        uniforms[i] = torch.rand(1, generator=seeded(s))[0]
    assert tokens == plain_inverse_cdf(logits, temperatures, uniforms).tolist()


def test_a_draw_at_the_top_of_the_cdf_falls_back_to_the_argmax():
    from pagedgen.engine.sampler import inverse_cdf

    # u = 1 puts the target on the total: the search runs off the end onto a zero weight.
    logits = torch.tensor([[0.0, 1.0, 0.5, float("-inf")], [0.0, 1.0, 0.5, 0.2]])
    uniforms = torch.tensor([1.0, 0.3])
    expected = plain_inverse_cdf(logits, torch.ones(2), uniforms)
    assert inverse_cdf(logits, uniforms).tolist() == expected.tolist() and expected[0] == 1


def test_temperature_one_skips_the_division():
    from pagedgen.engine.sampler import scale_by_temperature

    logits = torch.randn(3, 10)
    assert scale_by_temperature(logits, torch.ones(3)) is logits
    torch.testing.assert_close(scale_by_temperature(logits, torch.tensor([1.0, 2.0, 1.0])),
                               logits / torch.tensor([[1.0], [2.0], [1.0]]), rtol=0, atol=0)
