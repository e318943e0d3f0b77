"""LLM(batch_invariant=True): a request's tokens and logprobs are bitwise the same whatever
shares its batches, however its prompt is chunked, after a preemption, after a prefix-cache
hit, and for each sample of an n > 1 request (tiny model, bfloat16)."""
from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model_dir

from pagedgen import LLM, SamplingParams
from pagedgen.kernels import reference
from pagedgen.kernels.cpu import invariant_attention
from pagedgen.kernels.cpu.invariant_attention import paged_attention
from paged_batch import make_paged_batch
from pagedgen.model.layers.row_tiles import in_row_tiles

PREFIX = "def wrap(text, width=70, **kwargs):\n    "
PROMPTS = [PREFIX + "return", "import string", PREFIX + "w = TextWrapper(width=width)",
           "class Template:\n    delimiter = '$'", "x", PREFIX + "\"\"\"Wrap a single paragraph of text"]


def _params() -> list[SamplingParams]:
    """Greedy and seeded sampled requests, one with n=2 (two forks of one prompt)."""
    params = []
    for i in range(len(PROMPTS)):
        if i % 2 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=12,
                                         logprobs=2, ignore_eos=True, n=2 if i == 1 else 1))
    return params


def _llm(**options) -> LLM:
    base = dict(dtype="bfloat16", num_blocks=128, block_size=4, max_num_seqs=16,
                batch_invariant=True)
    return LLM(str(tiny_model_dir()), **{**base, **options})


def _signature(output) -> list:
    """Everything that must be bitwise equal: tokens, cumulative logprob, every logprob."""
    return [(s.token_ids, s.cumulative_logprob,
             [sorted((t, lp.logprob) for t, lp in step.items()) for step in s.logprobs])
            for s in output.outputs]


def _run(llm: LLM, order: list[int]) -> dict[int, list]:
    params = _params()
    outputs = llm.generate([PROMPTS[i] for i in order], [params[i] for i in order],
                           use_tqdm=False)
    return {i: _signature(out) for i, out in zip(order, outputs)}


@pytest.fixture(scope="module")
def alone() -> dict[int, list]:
    """Each request by itself, in a fresh engine with prefix caching off: no hits, no batch."""
    llm = _llm(enable_prefix_caching=False)
    return {i: _run(llm, [i])[i] for i in range(len(PROMPTS))}


@pytest.mark.parametrize("options, order", [
    ({}, list(range(len(PROMPTS)))),                                  # one batch, prefix hits
    ({"max_num_seqs": 2}, list(reversed(range(len(PROMPTS))))),       # other sizes and order
    ({"max_num_batched_tokens": 5, "max_num_seqs": 5}, [3, 0, 5, 1, 4, 2]),  # 5-token chunks
    ({"max_num_batched_tokens": 7, "max_num_seqs": 7, "enable_prefix_caching": False}, [5, 4, 3, 2, 1, 0]),
], ids=["together", "two-at-a-time-reversed", "chunks-of-5", "chunks-of-7"])
def test_batches_orders_and_chunking_change_no_bit(alone, options, order):
    llm = _llm(**options)
    assert _run(llm, order) == alone
    assert _run(llm, order) == alone  # again, now with every prompt a prefix-cache hit


def test_preemption_by_recompute_changes_no_bit(alone):
    llm = _llm(num_blocks=14, max_num_batched_tokens=16)
    assert _run(llm, list(range(len(PROMPTS)))) == alone
    assert llm.stats["preemptions"] > 0


def test_the_torch_attention_path_is_invariant_too(monkeypatch):
    """Where the native decode kernel does not apply: alone == chunked and preempted."""
    monkeypatch.setattr(invariant_attention.native, "decode_attention", lambda *args, **kwargs: False)
    single = _llm(enable_prefix_caching=False)
    alone = {i: _run(single, [i])[i] for i in range(len(PROMPTS))}
    llm = _llm(num_blocks=14, max_num_batched_tokens=5, max_num_seqs=5)
    assert _run(llm, [3, 0, 5, 1, 4, 2]) == alone
    assert llm.stats["preemptions"] > 0


@pytest.mark.parametrize("path", ["native", "torch"])
def test_invariant_attention_matches_the_reference_and_each_row_alone(path, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(invariant_attention.native, "decode_attention", lambda *args, **kwargs: False)
    batch = make_paged_batch([37, 5, 64, 20], [1, 5, 30, 1], num_q_heads=6, num_kv_heads=2,
                             head_dim=16, block_size=4, dtype=torch.bfloat16)
    got = paged_attention(*batch.attention_args(), 0.25)
    expected = reference.paged_attention(*batch.attention_args(), 0.25)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)
    for row in range(6, 36):  # the 30-query prefill chunk of sequence 2, one query at a time
        context = 64 - 30 + (row - 6) + 1
        one = paged_attention(batch.query[row:row + 1], batch.k_cache, batch.v_cache,
                              batch.block_tables[2:3], torch.tensor([context], dtype=torch.int32),
                              torch.tensor([0, 1], dtype=torch.int32), 0.25)
        assert torch.equal(one[0], got[row]), row


def test_row_tiles_give_each_row_the_same_bits_for_any_row_count():
    torch.manual_seed(0)
    weight = torch.randn(96, 64).bfloat16()
    x = torch.randn(300, 64).bfloat16()
    project = lambda rows: torch.nn.functional.linear(rows, weight)  # noqa: E731
    full = in_row_tiles(project, x, 32)
    assert full.shape == (300, 96)
    torch.testing.assert_close(full.float(), project(x).float(), atol=0.05, rtol=0.02)
    for count in (1, 2, 31, 33, 100):
        assert torch.equal(in_row_tiles(project, x[:count], 32), full[:count])


def test_the_default_path_is_not_batch_invariant():
    """Why the switch exists: without it, chunked prefill changes bf16 outputs (the flash
    prefill kernel and the decode kernel round differently, and the AMX and AVX-512 GEMMs
    change their summation order with the row count). Deterministic on one machine."""
    from pagedgen.kernels.cpu import native
    if native.gemm_kind() == "avx2":
        pytest.skip("the AVX2 GEMM sums in one order at every row count: on this CPU kind "
                    "these requests come out bitwise alike without the switch")
    single = _llm(batch_invariant=False, enable_prefix_caching=False)
    alone = {i: _run(single, [i])[i] for i in range(len(PROMPTS))}
    chunked = _run(_llm(batch_invariant=False, max_num_batched_tokens=5, max_num_seqs=5),
                   [3, 0, 5, 1, 4, 2])
    assert any(chunked[i] != alone[i] for i in alone)


def test_the_switch_reaches_the_runner_from_yaml_and_the_flag():
    from pagedgen.jobs.config import ConfigError, load_config
    from pagedgen.jobs.run_job import build_llm

    config = load_config(None, [("--batch-invariant", {"batch_invariant": True}),
                                ("--model", {"model": str(tiny_model_dir())}),
                                ("--num-blocks", {"num_blocks": 16})])
    assert build_llm(config).runner.batch_invariant
    assert not load_config().engine.batch_invariant
    with pytest.raises(ConfigError, match="batch_invariant"):
        load_config(None, [("--set batch_invariant=maybe", {"batch_invariant": "maybe"})])
