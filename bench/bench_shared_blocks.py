"""Decode attention where sequences share their leading blocks: the bf16 kernel reading each
shared block once per unit of sharers (share_blocks, the default) against once per sequence
(share_blocks=False), side by side, round-robin, on one decode step's worth of layers (each layer its own K/V pool, as in
the engine, so the shared prefix is not still in cache from the layer before).

Workloads, mid-decode, as the suite's (bench/peers/workload.py) hold them:
  shared-prefix  128 requests behind one 1,500-token system prompt (93 whole blocks shared),
                 own suffix 50-200 + 32 generated tokens;
  parallel       32 prompts of 256-512 tokens, n = 8 (the prompt's whole blocks shared by its 8
                 samples), 64 generated tokens each.
Shapes: 135m (SmolLM2-135M: 30 layers, 9 / 3 heads, head_dim 64) and 1b (Llama-3.2-1B: 16
layers, 32 / 8 heads, head_dim 64); bf16, block size 16.

    python bench/bench_shared_blocks.py [--threads 2] [--iters 7] [--shapes 135m,1b]
                                        [--workloads shared-prefix,parallel]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedgen.kernels.cpu import native

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers.cpu_info import cpu_info  # noqa: E402

BLOCK = 16


@dataclass(frozen=True)
class Shape:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int


SHAPES = {"135m": Shape(30, 9, 3, 64), "1b": Shape(16, 32, 8, 64)}


@dataclass(frozen=True)
class Group:
    shared: int             # tokens in whole shared blocks
    own: list[int]          # each member's tokens after them


def workload_groups(name: str, gen: torch.Generator) -> list[Group]:
    def uniform(low: int, high: int, count: int) -> list[int]:
        return torch.randint(low, high + 1, (count,), generator=gen).tolist()

    if name == "shared-prefix":
        prefix = 1500 // BLOCK * BLOCK
        return [Group(prefix, [1500 - prefix + own + 32 for own in uniform(50, 200, 128)])]
    if name == "parallel":
        groups = []
        for prompt in uniform(256, 512, 32):
            shared = prompt // BLOCK * BLOCK
            groups.append(Group(shared, [prompt - shared + 64] * 8))
        return groups
    raise ValueError(f"--workloads: unknown {name!r} (shared-prefix, parallel)")


@dataclass
class Step:
    query: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer
    kv_bytes_each: int      # K/V bytes of one layer, every sequence's context read
    kv_bytes_distinct: int  # the same with each shared block counted once


def build_step(groups: list[Group], shape: Shape, gen: torch.Generator) -> Step:
    rows, lens, next_block = [], [], 0
    for group in groups:
        shared = list(range(next_block, next_block + group.shared // BLOCK))
        next_block += len(shared)
        for own in group.own:
            own_blocks = -(-own // BLOCK)
            rows.append(shared + list(range(next_block, next_block + own_blocks)))
            next_block += own_blocks
            lens.append(group.shared + own)
    width = max(len(row) for row in rows)
    order = torch.randperm(next_block, generator=gen)  # scattered, as a used pool's
    tables = torch.tensor([[int(order[b]) for b in row] + [0] * (width - len(row))
                           for row in rows], dtype=torch.int64)
    pool = (next_block, BLOCK, shape.kv_heads, shape.head_dim)
    caches = [(torch.randn(pool, generator=gen).to(torch.bfloat16),
               torch.randn(pool, generator=gen).to(torch.bfloat16)) for _ in range(shape.layers)]
    query = torch.randn(len(rows), shape.q_heads, shape.head_dim, generator=gen).to(torch.bfloat16)
    token_bytes = 2 * shape.kv_heads * shape.head_dim * 2  # K and V, bf16
    distinct = sum(g.shared + sum(g.own) for g in groups)
    return Step(query, tables, torch.tensor(lens, dtype=torch.int64), caches,
                sum(lens) * token_bytes, distinct * token_bytes)


def run_step(step: Step, out: torch.Tensor, scale: float, share: bool) -> None:
    for k_cache, v_cache in step.caches:
        assert native.decode_attention(step.query, k_cache, v_cache, step.tables, step.lens,
                                       scale, out, share_blocks=share)


def timed_pair(step: Step, iters: int) -> tuple[list[float], list[float]]:
    """Seconds per step with sharing on and off, alternating; the outputs compared once."""
    scale = step.query.shape[-1] ** -0.5
    outs = {True: torch.empty_like(step.query), False: torch.empty_like(step.query)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(iters + 1):
        for on in (True, False):
            start = time.perf_counter()
            run_step(step, outs[on], scale, on)
            if round_:  # the first round warms up
                times[on].append(time.perf_counter() - start)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-6, rtol=2.0 ** -7)
    return times[True], times[False]


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--shapes", default="135m,1b")
    parser.add_argument("--workloads", default="shared-prefix,parallel")
    opts = parser.parse_args()
    if native.load() is None:
        raise SystemExit("the native kernels did not build here")
    torch.set_num_threads(opts.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {cpu_info().summary()}; threads {opts.threads}; "
          f"bf16; block size {BLOCK}; medians of {opts.iters} alternating steps")
    print("| workload | shape | sequences | K/V per step MiB: each / distinct | step ms: shared "
          "once / per sequence | ratio | GB/s of the bytes each path reads |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for workload in opts.workloads.split(","):
        for shape_name in opts.shapes.split(","):
            if shape_name not in SHAPES:
                raise SystemExit(f"--shapes: unknown {shape_name!r} ({', '.join(SHAPES)})")
            shape = SHAPES[shape_name]
            gen = torch.Generator().manual_seed(0)
            step = build_step(workload_groups(workload, gen), shape, gen)
            on, off = timed_pair(step, opts.iters)
            each = step.kv_bytes_each * shape.layers
            distinct = step.kv_bytes_distinct * shape.layers
            print(f"| {workload} | {shape_name} | {len(step.lens)} | {each / 2**20:,.0f} / "
                  f"{distinct / 2**20:,.0f} | {median(on) * 1e3:,.1f} / {median(off) * 1e3:,.1f} | "
                  f"**{median(off) / median(on):.2f}x** | {distinct / median(on) / 1e9:.1f} / "
                  f"{each / median(off) / 1e9:.1f} |", flush=True)
            del step


if __name__ == "__main__":
    main()
