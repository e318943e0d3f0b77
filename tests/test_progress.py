"""The progress display: the ETA counted in tokens, the bar's figures, the final line.

The ETA estimator is a pure function, so its accuracy is checked on simulated jobs with a fake
clock (a step costs a fixed part plus a part per token, as engine steps do), then once on a
real run of a tiny model.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from rich.console import Console

from pagedgen.progress import (GenerationProgress, StepCosts, WorkLeft, estimate_eta,
                               fit_step_cost, survival, tokens_and_steps_left)

TOLERANCE = 0.35
# Output lengths the default model gave on samples/questions.jsonl (greedy, max_tokens 96):
# 83 stopped at EOS, 13 reached max_tokens.
DEFAULT_MODEL_LENGTHS = [
    5, 5, 6, 6, 6, 7, 7, 7, 8, 8, 9, 9, 9, 9, 9, 10, 10, 11, 12, 13, 14, 15, 16, 17, 18, 18, 18, 19,
    20, 20, 20, 21, 22, 22, 22, 23, 23, 24, 24, 24, 24, 25, 25, 26, 26, 26, 27, 27, 29, 29, 29, 30,
    32, 33, 34, 34, 35, 35, 37, 37, 39, 42, 46, 46, 48, 51, 51, 52, 52, 57, 59, 59, 61, 61, 62, 62,
    64, 75, 76, 78, 78, 80, 83] + [1000] * 13


def simulate(lengths, caps, prompts, max_parallel, cost, seed=0):
    """Runs a fake engine: admits up to max_parallel sequences, prefills a prompt in its first
    step, then one token per step until its EOS length or cap. Yields (clock, costs, work)."""
    rng = np.random.default_rng(seed)
    n = len(lengths)
    generated = np.zeros(n, dtype=np.int64)
    done = np.zeros(n, dtype=bool)
    started = np.zeros(n, dtype=bool)
    costs, clock = StepCosts(), 0.0
    stopped, capped = [], []
    while not done.all():
        running = np.flatnonzero(started & ~done)
        room = max_parallel - running.size
        new = np.flatnonzero(~started)[:max(0, room)]
        started[new] = True
        prefill = int(prompts[new].sum())
        active = np.concatenate([running, new])
        generated[active] += 1
        step_s = cost(active.size, prefill) * rng.uniform(0.9, 1.1)
        clock += step_s
        costs.add(step_s, int(active.size), prefill)
        for i in active:
            if generated[i] >= lengths[i] or generated[i] >= caps[i]:
                done[i] = True
                (stopped if generated[i] >= lengths[i] and lengths[i] <= caps[i] else capped).append(
                    int(generated[i]))
        left = ~done
        work = WorkLeft(generated[left].copy(), caps[left].copy(),
                        int(prompts[left & ~started].sum()), np.asarray(stopped), np.asarray(capped),
                        max_parallel)
        yield clock, costs, work


def eta_error_at_half(lengths, caps, prompts, max_parallel, cost):
    frames = [(clock, estimate_eta(costs, work))
              for clock, costs, work in simulate(lengths, caps, prompts, max_parallel, cost)]
    wall = frames[-1][0]
    clock, eta = next((c, e) for c, e in frames if c >= wall / 2)
    remaining = wall - clock
    return (eta - remaining) / remaining


def cpu_like_cost(batch, prefill):   # fixed part + per decode token + per prompt token
    return 0.020 + 0.0008 * batch + 0.00005 * prefill


def overhead_bound_cost(batch, prefill):   # a tiny model: the fixed part dominates
    return 0.008 + 0.00005 * batch + 0.00001 * prefill


@pytest.mark.parametrize("cost", [cpu_like_cost, overhead_bound_cost])
@pytest.mark.parametrize("shape", ["geometric", "default_model"])
@pytest.mark.parametrize("max_parallel", [256, 32])
def test_eta_at_half_time_within_35_percent(cost, shape, max_parallel):
    """96 requests stopping at EOS: the ETA shown at half the wall is within 35% of the rest.
    Lengths: geometric (a constant chance to stop, as a sampled random model gives), or those
    the default model gave on samples/questions.jsonl, in a shuffled order."""
    rng = np.random.default_rng(7)
    n, cap = 96, 96
    if shape == "geometric":
        lengths = rng.geometric(1 / 30, n)
    else:
        lengths = rng.permutation(DEFAULT_MODEL_LENGTHS)
    prompts = rng.integers(10, 60, n)
    error = eta_error_at_half(lengths, np.full(n, cap), prompts, max_parallel, cost)
    assert abs(error) <= TOLERANCE, f"ETA off by {error:+.0%} at half time"


def test_a_count_of_requests_would_fail_where_tokens_succeed():
    """Requests that all end together: at half time none is done, so a per-request ETA has
    nothing to go on, while the token estimate (all run to max_tokens here) is right."""
    n = 96
    lengths, caps = np.full(n, 1000), np.full(n, 64)
    error = eta_error_at_half(lengths, caps, np.full(n, 20), 256, cpu_like_cost)
    assert abs(error) <= 0.10


def test_survival_product_limit_and_censoring():
    s = survival(np.array([2, 2, 4]), np.array([3]), horizon=5)
    # at t=2: 4 at risk, 2 events -> 0.5; t=3: 2 at risk, 0 events; t=4: 1 at risk, 1 event -> 0
    assert s[:5].tolist() == [1.0, 1.0, 0.5, 0.5, 0.0]
    assert survival(np.array([], dtype=int), np.array([3, 4]), 4).tolist() == [1.0] * 5


def test_no_stop_seen_means_every_sequence_runs_to_its_cap():
    work = WorkLeft(np.array([0, 10]), np.array([20, 20]), 0, np.array([], dtype=int),
                    np.array([], dtype=int))
    tokens, steps = tokens_and_steps_left(work)
    assert tokens == pytest.approx(30) and steps == pytest.approx(20)


def test_cost_fit_recovers_a_linear_step_cost():
    costs = StepCosts()
    rng = np.random.default_rng(0)
    for _ in range(200):
        batch, prompt = int(rng.integers(1, 64)), int(rng.integers(0, 500))
        costs.add(0.01 + 0.001 * batch + 0.0001 * prompt, batch, prompt)
    a, b, c = fit_step_cost(costs)
    assert (a, b, c) == pytest.approx((0.01, 0.001, 0.0001), rel=0.05)   # the ridge pulls a little
    assert estimate_eta(StepCosts(), WorkLeft(np.array([1]), np.array([2]), 0,
                                              np.array([1]), np.array([], dtype=int))) is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Out:
    def __init__(self, n_tokens: int, reason: str) -> None:
        self.outputs = [type("Sample", (), {"token_ids": [0] * n_tokens, "finish_reason": reason})()]


def test_plain_lines_off_a_terminal_and_the_final_line():
    stream = io.StringIO()
    clock = FakeClock()
    progress = GenerationProgress(4, 100, console=Console(file=stream, width=200), clock=clock)
    work = lambda: WorkLeft(np.array([5]), np.array([10]), 0, np.array(progress.stopped),  # noqa: E731
                            np.array(progress.capped))
    with progress:
        for step in range(1, 21):
            clock.now = step * 0.5
            if step == 10:
                progress.finished([Out(3, "stop"), Out(10, "length")])
            progress.step(step * 4, 100, 7, work)
    text = stream.getvalue()
    assert "generating 2/4 req" in text and "gen tok/s" in text and "ETA" in text
    assert text.strip().splitlines()[-1] == (
        "2 requests in 10.0 s: 8 generated tok/s, 10 prompt tok/s; KV peak 7 of 100 blocks (7.0%)")
    assert progress.totals.as_dict()["generated_tok_per_s"] == 8.0
    assert progress.stopped == [3] and progress.capped == [10]


def test_quiet_prints_nothing():
    stream = io.StringIO()
    with GenerationProgress(1, 10, enabled=False, console=Console(file=stream)) as progress:
        progress.step(1, 1, 1)
    assert stream.getvalue() == "" and progress.totals is not None


def test_real_run_eta_at_half_time(monkeypatch):
    """The real engine's finishing pattern: a tiny model, 96 requests that stop on stop tokens
    (what EOS does), the ETA recorded at every step. Time is one tick per engine step, not the
    wall clock (a shared machine's noise would decide the test); the bound is a sanity one
    (within a factor of 2), the 35% bound is the simulated tests'."""
    from tiny_models import tiny_model_dir

    import pagedgen.llm as llm_module
    import pagedgen.progress as progress_module
    from pagedgen import LLM, SamplingParams

    frames, ticks = [], [0.0]

    class Recording(GenerationProgress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, clock=lambda: ticks[0], **kwargs)

        def step(self, *args, **kwargs):
            ticks[0] += 1.0
            super().step(*args, **kwargs)
            frames.append((self.clock() - self._start, self.eta, self.done))

    monkeypatch.setattr(progress_module, "ETA_EVERY_S", 0.0)
    monkeypatch.setattr(llm_module, "GenerationProgress", Recording)
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", threads=1, show_progress=False)
    stops = list(range(40, 52))     # 12 of 512 tokens end a request: ~2% a token
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160, stop_token_ids=stops)
              for i in range(96)]
    outputs = llm.generate([f"request {i}: " for i in range(96)], params, use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert reasons.count("stop") > 48                      # most stop early, as with EOS
    wall = frames[-1][0]
    clock, eta, _ = next(f for f in frames if f[0] >= wall / 2)
    remaining = wall - clock
    print(f"real run: {wall:.0f} steps, at half: ETA {eta:.1f} steps, remained {remaining:.0f}")
    assert eta is not None and remaining / 2 <= eta <= 2 * remaining, (eta, remaining)
