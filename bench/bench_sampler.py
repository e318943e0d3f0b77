"""The sampler's full-vocabulary draw at the `parallel` workload's shape, against the plain
formulation of the same draw, side by side in one process.

256 rows (32 prompts x n = 8) of float32 logits over a 49,152-token vocabulary, temperature 1
(or --temperature), no top-k / top-p: the path every row of `parallel` takes each step. The
plain formulation divides by the temperature and computes the fallback argmax every time; the
sampler skips the division at temperature 1, takes the row maxima without their indices,
accumulates the weights in place and runs the argmax only for rows whose draw lands on a zero
weight. Both draw from the same uniform numbers; the script checks that their tokens are
identical, then alternates the two and prints medians and the median of their paired ratios.

    python bench/bench_sampler.py --threads 1 --repeats 41
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedgen.engine.sampler import Sampler, build_batch
from pagedgen.engine.sampling_params import SamplingParams
from pagedgen.model.runtime.cpu_malloc import keep_freed_memory


class Row:
    """What the sampler reads of an engine sequence."""

    def __init__(self, params: SamplingParams) -> None:
        self.params, self.generator, self.token_ids, self.prompt_len = params, None, [1], 1

    def banned_token_ids(self) -> list[int]:
        return []


def plain_draw(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Divide, exponentiate, accumulate, search, and the fallback argmax, unconditionally."""
    scaled = logits / temperature[:, None]
    weights = (scaled - scaled.max(dim=-1, keepdim=True).values).exp_()
    cumulative = weights.cumsum(dim=-1)
    target = (uniforms * cumulative[:, -1])[:, None]
    index = torch.searchsorted(cumulative, target, right=True).clamp_max_(weights.shape[-1] - 1)
    landed_on_zero = weights.gather(1, index) <= 0
    return torch.where(landed_on_zero, weights.argmax(dim=-1, keepdim=True), index).squeeze(1)


def time_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=41)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()   # the engine's malloc settings: large temporaries are reused, not faulted in
    logits = 4.0 * torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    batch = build_batch([Row(SamplingParams(temperature=args.temperature))] * args.rows, args.vocab, "cpu")
    temperature = torch.full((args.rows,), args.temperature)

    def sampler_tokens(seed: int) -> list[int]:
        return Sampler(torch.Generator().manual_seed(seed))(logits, batch).token_ids

    def plain_tokens(seed: int) -> list[int]:
        uniforms = torch.rand(args.rows, generator=torch.Generator().manual_seed(seed))
        return plain_draw(logits, temperature, uniforms).tolist()

    same = all(sampler_tokens(seed) == plain_tokens(seed) for seed in range(5))
    plain, sampler = [], []
    for seed in range(args.repeats):   # alternating: both see the same machine load
        plain.append(time_ms(lambda: plain_tokens(seed)))
        sampler.append(time_ms(lambda: sampler_tokens(seed)))
    ratio = statistics.median(s / p for s, p in zip(sampler, plain))
    print(f"{args.rows} x {args.vocab} float32, temperature {args.temperature}, threads {args.threads}, "
          f"medians of {args.repeats}; tokens identical: {same}")
    print(f"plain formulation  {statistics.median(plain):8.2f} ms per step")
    print(f"sampler            {statistics.median(sampler):8.2f} ms per step (the whole call)")
    print(f"sampler / plain    {ratio:8.3f} (median of paired ratios)")


if __name__ == "__main__":
    main()
