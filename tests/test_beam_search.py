"""Beam search equals transformers' generate(num_beams=k, num_return_sequences=k, do_sample=False).

Same k sequences in the same order, same scores and cumulative log-probabilities (within 1e-4),
float32, for beam widths 1, 2, 4, 8 and block sizes 8, 16; with EOS forced to occur (a token the
model favours is made the EOS) and without EOS; and with a pool small enough to preempt.
"""

from __future__ import annotations

import functools
import io

import pytest
import torch

from rich.console import Console

from pagedgen import LLM, BeamSearchParams
from pagedgen.memory.render import render_report
from tiny_models import tiny_hf_model, tiny_model_dir

PAD = 0
PENALTY = {1: 1.0, 2: 0.5, 4: 2.0, 8: 1.0}   # length_penalty per width: cover a few values
# With EOS, penalties that do not favour long beams, so that EOS-ended ones make the top k.
PENALTY_EOS = {1: 1.0, 2: 0.5, 4: 0.0, 8: -0.5}


@functools.cache
def prompts() -> tuple[tuple[int, ...], ...]:
    gen = torch.Generator().manual_seed(7)
    return tuple(tuple(torch.randint(3, 500, (n,), generator=gen).tolist()) for n in (6, 11, 19))


@functools.cache
def favoured_token() -> int:
    """A token greedy decoding of the first prompt emits early: as EOS, beams do hit it."""
    out = tiny_hf_model().generate(torch.tensor([prompts()[0]]), max_new_tokens=3,
                                   do_sample=False, eos_token_id=None, pad_token_id=PAD)
    return int(out[0, -1])


def make_llm(block_size: int, num_blocks: int = 400, eos: int | None = None, **kwargs) -> LLM:
    llm = LLM(str(tiny_model_dir()), dtype="float32", block_size=block_size,
              num_blocks=num_blocks, threads=1, **kwargs)
    if eos is not None:
        llm.engine.eos_token_ids = frozenset({eos})
    return llm


def reference(prompt, width: int, max_tokens: int, penalty: float, eos: int | None,
              early_stopping=False) -> list[tuple[list[int], float, float]]:
    """transformers' beams: (output tokens, score, cumulative logprob) best first."""
    out = tiny_hf_model().generate(
        torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
        max_new_tokens=max_tokens, length_penalty=penalty, early_stopping=early_stopping,
        eos_token_id=eos, pad_token_id=PAD, return_dict_in_generate=True, output_scores=True)
    if width == 1:  # generate() runs greedy search: sum the chosen tokens' log-probabilities
        return [_greedy_beam(out, len(prompt), penalty, eos)]
    beams = []
    for seq, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        seq = _cut_at_eos(seq, eos)
        beams.append((seq, score, score * len(seq) ** penalty))
    return beams


def _cut_at_eos(seq: list[int], eos: int | None) -> list[int]:
    return seq[:seq.index(eos) + 1] if eos is not None and eos in seq else seq


def _greedy_beam(out, prompt_len: int, penalty: float, eos: int | None):
    seq = _cut_at_eos(out.sequences[0, prompt_len:].tolist(), eos)
    cumulative = sum(float(torch.log_softmax(step[0].float(), -1)[token])
                     for step, token in zip(out.scores, seq))
    return seq, cumulative / len(seq) ** penalty, cumulative


def check_equal(llm: LLM, width: int, max_tokens: int, penalty: float, eos: int | None,
                early_stopping=False) -> list[str]:
    params = BeamSearchParams(width, max_tokens, ignore_eos=eos is None, length_penalty=penalty,
                              early_stopping=early_stopping)
    outputs = llm.beam_search([{"prompt_token_ids": list(p)} for p in prompts()], params,
                              use_tqdm=False)
    reasons = []
    for prompt, output in zip(prompts(), outputs):
        expected = reference(prompt, width, max_tokens, penalty, eos, early_stopping)
        got = output.sequences
        assert [b.output_token_ids for b in got] == [e[0] for e in expected]
        for beam, (tokens, score, cumulative) in zip(got, expected):
            assert beam.score == pytest.approx(score, abs=1e-4)
            assert beam.cum_logprob == pytest.approx(cumulative, abs=1e-4)
            assert beam.tokens == list(prompt) + tokens
        reasons += [b.finish_reason for b in got]
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.snapshot().blocks_used == 0
    return reasons


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_beam_search_equals_transformers_without_eos(width, block_size):
    reasons = check_equal(make_llm(block_size), width, 10, PENALTY[width], None)
    assert set(reasons) == {"length"}


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_beam_search_equals_transformers_with_eos(width, block_size):
    eos = favoured_token()
    reasons = check_equal(make_llm(block_size, eos=eos), width, 10, PENALTY_EOS[width], eos)
    assert "stop" in reasons  # EOS did end some hypotheses


@pytest.mark.parametrize("early_stopping", [True, "never"])
def test_early_stopping_modes_match_transformers(early_stopping):
    eos = favoured_token()
    check_equal(make_llm(8, eos=eos), 4, 12, 1.0, eos, early_stopping)


def test_beam_groups_preempted_by_recompute_still_match():
    eos = favoured_token()
    llm = make_llm(8, num_blocks=24, eos=eos)   # one group's worst case fits, three do not
    check_equal(llm, 8, 12, 1.0, eos)
    assert llm.stats["preemptions"] > 0


def test_beams_share_blocks_and_drop_them_at_once():
    llm = make_llm(8)
    llm.beam_search([{"prompt_token_ids": list(p)} for p in prompts()],
                    BeamSearchParams(4, 12, ignore_eos=True), use_tqdm=False)
    report = llm.memory_report()
    summary, unshared = report["summary"], report["counterfactual"]["no_sharing"]
    assert summary["cow_copies"] > 0
    assert summary["peak_blocks_used"] < summary["logical_blocks_at_peak"] <= unshared["peak_blocks"]
    assert unshared["sharing_saved_blocks"] == unshared["peak_blocks"] - summary["peak_blocks_used"]
    assert llm.engine.scheduler.stats.prompt_tokens_computed == sum(len(p) for p in prompts())
    # The block map: a request's beams are its samples, their common blocks shown with ref > 1.
    tables = report["peak_block_tables"]["sequences"]
    beams = [t for t in tables if t["request_id"] == "0"]
    assert len(beams) == 4 and len({t["sample_index"] for t in beams}) == 4
    first = beams[0]["block_table"][0]
    assert all(t["block_table"][0] == first for t in beams) and beams[0]["ref_counts"][0] == 4
    console = Console(file=io.StringIO(), width=120)
    render_report(report, console)
    assert "Block sharing" in console.file.getvalue()


def test_beam_search_runs_beside_plain_requests_in_the_same_steps():
    from pagedgen import SamplingParams

    llm = make_llm(16)
    prompt = list(prompts()[1])
    llm.engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=10,
                                                            ignore_eos=True))
    outputs = llm.beam_search([{"prompt_token_ids": list(p)} for p in prompts()],
                              BeamSearchParams(2, 10, ignore_eos=True), use_tqdm=False)
    assert llm.stats["steps"] <= 12   # the plain request did not take steps of its own
    expected = reference(prompts()[0], 2, 10, 1.0, None)
    assert [b.output_token_ids for b in outputs[0].sequences] == [e[0] for e in expected]


def test_bad_beam_params_are_named():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(2, 4, early_stopping="sometimes")


def test_beam_group_that_cannot_fit_fails_alone_with_a_reason():
    llm = make_llm(8, num_blocks=12)
    outputs = llm.beam_search([{"prompt_token_ids": list(prompts()[0])}] * 2,
                              BeamSearchParams(8, 40, ignore_eos=True), use_tqdm=False)
    assert all("beam_width 8" in o.error and "KV blocks" in o.error for o in outputs)
    assert all(o.sequences == [] for o in outputs)
    ok = llm.beam_search([{"prompt_token_ids": list(prompts()[0])}],
                         BeamSearchParams(2, 8, ignore_eos=True), use_tqdm=False)[0]
    assert ok.error is None and len(ok.sequences) == 2
