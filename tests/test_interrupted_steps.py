"""Ctrl-C (or any error) at any point of `generate` leaves the engine as good as new.

A KeyboardInterrupt is raised at the N-th traced line of pagedgen's own code while a batch runs
(sys.settrace: every line boundary is a point where a real signal handler could raise). The
cut may fall inside a step or inside one of the KV manager's updates. Afterwards the engine
holds no request and no block, its counts add up, and the same prompts give the same tokens
as on a fresh engine: no block whose KV the cut step never wrote is served from the prefix
cache (every block free of content holds garbage before the cut run, so one served unwritten
changes the tokens).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedgen
from pagedgen import LLM, SamplingParams
from tiny_models import tiny_model_dir

PACKAGE = str(Path(pagedgen.__file__).parent)
# Shared prompt heads (prefix-cache hits), n = 2 (forks and copy-on-write) and a pool small
# enough to preempt: the engine's paths that change the block tables.
PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19 + i, 40 + i] for i in range(4)]
PARAMS = [SamplingParams(n=1 + i % 2, temperature=0, max_tokens=12, ignore_eos=True)
          for i in range(len(PROMPTS))]


class LineCounter:
    """A trace function over pagedgen's code that raises KeyboardInterrupt at line `cut`
    (never, when None) and counts the lines it saw."""

    def __init__(self, cut: int | None):
        self.cut, self.lines = cut, 0

    def __call__(self, frame, event, _arg):
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if event == "line":
            self.lines += 1
            if self.lines == self.cut:
                sys.settrace(None)
                raise KeyboardInterrupt
        return self

    def run(self, function):
        sys.settrace(self)
        try:
            return function()
        finally:
            sys.settrace(None)


def fill_plain_free_blocks(llm: LLM, value: float) -> None:
    kv = llm.engine.kv
    plain = [b for b in range(kv.num_blocks) if kv.ref_count(b) == 0 and not kv.is_cached(b)]
    llm.engine.runner.kv_cache[:, :, plain] = value


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


# Pools that preempt: the hybrid model's pages serve its eight layer groups.
POOLS = {"llama": 12, "gemma3": 60}


def cold_engine(arch: str) -> LLM:
    return LLM(str(tiny_model_dir(arch)), dtype="float32", block_size=4, num_blocks=POOLS[arch],
               max_num_seqs=4, enable_prefix_caching=True, seed=0)


def generate(llm: LLM):
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


@functools.cache
def uncut_run(arch: str) -> tuple[list, int]:
    """The tokens of an uncut run and the lines a run from a cold engine traces. One run
    first, untraced: the process's first generate also runs one-time set-up (lazy imports,
    cached probes) that later runs skip, and counting it would put the late cuts past the
    end of every run after it."""
    generate(cold_engine(arch))
    llm = cold_engine(arch)
    counter = LineCounter(None)
    expected = tokens(counter.run(lambda: generate(llm)))
    assert llm.engine.scheduler.stats.preemptions > 0, "the pool is meant to preempt"
    return expected, counter.lines


def assert_as_good_as_new(llm: LLM, expected) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    engine.kv.check_integrity()
    assert engine.kv.snapshot().blocks_used == 0
    fill_plain_free_blocks(llm, 7.0)   # what an unwritten block would hold if served
    assert tokens(generate(llm)) == expected


# Per mille of the way through, drawn as an integer: a native library may have set
# flush-to-zero, and hypothesis then refuses to draw floats.
@pytest.mark.parametrize("arch", list(POOLS))
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(per_mille=st.integers(0, 1000))
def test_a_cut_at_any_line_leaves_the_engine_as_good_as_new(arch, per_mille):
    expected, lines = uncut_run(arch)
    llm = cold_engine(arch)
    fill_plain_free_blocks(llm, 7.0)
    with pytest.raises(KeyboardInterrupt):
        LineCounter(1 + (lines - 1) * per_mille // 1000).run(lambda: generate(llm))
    assert_as_good_as_new(llm, expected)


def test_a_cut_forward_leaves_no_unwritten_block_in_the_prefix_cache(monkeypatch):
    """Each step's forward cut in turn: its blocks were hashed when the step was scheduled,
    before the forward that never ran could write them. (The KV manager's rule is the same
    for one group and many: the full-attention model's many short steps suffice.)"""
    arch = "llama"
    expected, _ = uncut_run(arch)
    steps = 1
    while True:
        llm = cold_engine(arch)
        fill_plain_free_blocks(llm, 7.0)
        forward, calls = llm.engine.runner.execute, []

        def cut(*args, **kwargs):
            calls.append(1)
            if len(calls) == steps:
                raise KeyboardInterrupt
            return forward(*args, **kwargs)
        monkeypatch.setattr(llm.engine.runner, "execute", cut)
        try:
            generate(llm)
            assert steps > 2, "the workload is meant to take several steps"
            return                     # past the last step
        except KeyboardInterrupt:
            pass
        monkeypatch.setattr(llm.engine.runner, "execute", forward)
        assert_as_good_as_new(llm, expected)
        steps += 1
