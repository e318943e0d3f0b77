"""The engine's Python work per step at many running sequences, without a model.

A stand-in runner returns zero logits, so a step's time is the scheduler, the sampler on a small
vocabulary and the engine's bookkeeping alone. Runs the `parallel` shape (prompts forked into
n samples at temperature 1) with the scheduler as it is and with its per-sequence room check
replaced by the general KVCacheManager.can_append (what it did before the short cut),
alternating, and prints medians and their ratio.

    python bench/bench_scheduler_step.py --prompts 32 --n 8 --repeats 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pagedgen.engine.engine import LLMEngine
from pagedgen.settings import EngineConfig
from pagedgen.engine.sampling_params import SamplingParams


class ZeroLogitsRunner:
    """Runner protocol: one row of zero logits per sampled chunk, nothing computed."""

    def __init__(self, num_blocks: int, block_size: int, vocab: int) -> None:
        self.num_blocks, self.block_size, self.vocab = num_blocks, block_size, vocab
        self.device = torch.device("cpu")

    def execute(self, batch: list, copies: list[tuple[int, int]]) -> torch.Tensor:
        return torch.zeros(sum(1 for chunk in batch if chunk.sample), self.vocab)


def one_run(args, general_check: bool) -> tuple[float, float]:
    """(mean scheduling ms per step, mean step ms) over the run's steps."""
    runner = ZeroLogitsRunner(num_blocks=args.prompts * args.n * 64, block_size=16, vocab=256)
    seats = args.prompts * args.n
    engine = LLMEngine(runner, None, [], EngineConfig(max_num_seqs=seats, max_num_batched_tokens=8192,
                                                      max_model_len=4096))
    scheduler = engine.scheduler
    if general_check:
        scheduler._fits = lambda seq, n: scheduler.kv.can_append([seq.seq_id], n)
    schedule, spent = scheduler.schedule, [0.0]

    def timed_schedule():
        start = time.perf_counter()
        try:
            return schedule()
        finally:
            spent[0] += time.perf_counter() - start
    scheduler.schedule = timed_schedule

    rng = random.Random(0)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.prompts):
        engine.add_request(f"r{i}", [rng.randrange(256) for _ in range(rng.randint(256, 512))], params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    total = time.perf_counter() - start
    return 1e3 * spent[0] / steps, 1e3 * total / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {False: [], True: []}
    for _ in range(args.repeats):
        for general in (False, True):   # alternating: both see the same machine load
            results[general].append(one_run(args, general))
    for general, label in ((True, "general can_append (before)"), (False, "per-sequence short cut (after)")):
        sched = statistics.median(r[0] for r in results[general])
        step = statistics.median(r[1] for r in results[general])
        print(f"{label:32s} scheduling {sched:6.2f} ms/step, whole step {step:6.2f} ms/step")
    ratio = statistics.median(a[0] / b[0] for a, b in zip(results[False], results[True]))
    step_ratio = statistics.median(a[1] / b[1] for a, b in zip(results[False], results[True]))
    print(f"after / before, median of paired runs: scheduling {ratio:.2f}, whole step {step_ratio:.2f} "
          f"({args.prompts} prompts x n={args.n}, {args.max_tokens} new tokens, threads 1)")


if __name__ == "__main__":
    main()
