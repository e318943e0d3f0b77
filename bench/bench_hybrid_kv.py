"""KV memory of a hybrid pool (sliding groups releasing blocks) against a full-attention pool,
on Gemma 3 270M's KV shape: 18 layers (5 sliding, then 1 global, repeated), window 512, one KV
head of dim 256, bf16 -> 3 layers per page, one full group and five sliding groups.

Memory does not depend on what the model computes, only on which tokens the scheduler runs and
what the KV manager holds, so the real engine (scheduler, KV manager, memory tracker) runs here
with a stand-in runner that returns random logits instead of a forward pass. Both figures are
read from the pool (the tracker's peak of used blocks x page bytes):

* peak:        16 sequences of 8,192 tokens (8,064 prompt + 128 generated) in one pool big
               enough for all: hybrid peak KV bytes / full-attention peak KV bytes (target <= 0.25);
* concurrency: a 1 GiB pool; the most 8,192-token sequences run at once without a single
               preemption (largest max_num_seqs with zero preemptions): hybrid / full (>= 3.5).

    python bench/bench_hybrid_kv.py                 # the 270M shapes above
    python bench/bench_hybrid_kv.py --scale 16      # lengths and window / 16 (the CI version)
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

import torch

from pagedgen.engine.engine import LLMEngine
from pagedgen.settings import EngineConfig
from pagedgen.engine.sampling_params import SamplingParams
from pagedgen.memory.tracker import MemoryTracker
from pagedgen.model.runtime.kv_cache import kv_bytes_per_token
from pagedgen.model.runtime.kv_groups import group_layers_by_window

GEMMA_270M_WINDOWS = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
KV_HEADS, HEAD_DIM, DTYPE = 1, 256, torch.bfloat16


@dataclass(slots=True)
class Shape:
    windows: tuple[int, ...] = GEMMA_270M_WINDOWS
    seq_len: int = 8192
    # Generated tokens: enough decode steps that all 16 sequences (prefilled one after another,
    # 4 chunks each) are resident at once near their full length.
    new_tokens: int = 128
    block_size: int = 16
    chunk: int = 2048   # max_num_batched_tokens

    def scaled(self, factor: int) -> "Shape":
        return Shape(tuple(w // factor for w in self.windows), self.seq_len // factor,
                     min(96, self.seq_len // factor // 4), max(self.block_size // 2, 4),
                     max(self.chunk // factor, 64))


class LogitsOnlyRunner:
    """What the engine needs of a runner, without a model: random logits per sampled chunk."""

    def __init__(self, shape: Shape, hybrid: bool, pool_bytes: int) -> None:
        layout = group_layers_by_window(shape.windows if hybrid else (0,) * len(shape.windows))
        self.group_windows = layout.group_windows
        self.group_layers = tuple(len(layout.group_layers(g)) for g in range(layout.num_groups))
        self.block_size, self.device = shape.block_size, torch.device("cpu")
        self.kv_bytes_per_token = kv_bytes_per_token(layout.group_size, KV_HEADS, HEAD_DIM, DTYPE)
        self.full_bytes_per_token = kv_bytes_per_token(len(shape.windows), KV_HEADS, HEAD_DIM,
                                                       DTYPE)
        self.num_blocks = pool_bytes // (self.kv_bytes_per_token * shape.block_size)
        self._gen = torch.Generator().manual_seed(0)

    def execute(self, batch: list, copies: list[tuple[int, int]]) -> torch.Tensor:
        rows = sum(1 for chunk in batch if chunk.sample)
        return torch.randn(rows, 256, generator=self._gen)


def run(shape: Shape, hybrid: bool, pool_bytes: int, num_seqs: int,
        max_num_seqs: int) -> dict:
    """num_seqs sequences of shape.seq_len tokens; the pool's peak and the preemptions."""
    runner = LogitsOnlyRunner(shape, hybrid, pool_bytes)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=shape.chunk,
                          max_model_len=shape.seq_len + 1)
    engine = LLMEngine(runner, None, [], config)
    hybrid_fields = {} if len(runner.group_windows) == 1 else {
        "group_windows": runner.group_windows, "group_layers": runner.group_layers,
        "full_attention_bytes_per_token": runner.full_bytes_per_token}
    tracker = MemoryTracker(shape.block_size, runner.num_blocks, runner.kv_bytes_per_token,
                            "bfloat16", shape.seq_len + 1, **hybrid_fields)
    engine.attach_tracker(tracker)
    rng = random.Random(1)
    prompt_len = shape.seq_len - shape.new_tokens
    params = SamplingParams(temperature=0, max_tokens=shape.new_tokens, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(256) for _ in range(prompt_len)], params)
    failed = 0
    while engine.has_unfinished():
        failed += sum(1 for out in engine.step() if out.error)
    engine.kv.check_integrity()
    page_bytes = runner.kv_bytes_per_token * shape.block_size
    return {"hybrid": hybrid, "num_blocks": runner.num_blocks, "page_bytes": page_bytes,
            "peak_blocks": tracker.peak.blocks_used,
            "peak_bytes": tracker.peak.blocks_used * page_bytes,
            "peak_running": tracker.peak_running, "failed": failed,
            "preemptions": engine.scheduler.stats.preemptions,
            "window_released": engine.kv.counters.window_released}


def peak_ratio(shape: Shape, num_seqs: int = 16) -> dict:
    """Peak KV bytes of num_seqs sequences, hybrid and full attention, each in a pool big
    enough to run all of them at once."""
    full_bytes = kv_bytes_per_token(len(shape.windows), KV_HEADS, HEAD_DIM, DTYPE)
    roomy = (num_seqs + 1) * (shape.seq_len + shape.block_size) * full_bytes
    hybrid = run(shape, True, roomy, num_seqs, num_seqs)
    full = run(shape, False, roomy, num_seqs, num_seqs)
    assert hybrid["preemptions"] == full["preemptions"] == 0
    assert hybrid["peak_running"] == full["peak_running"] == num_seqs
    return {"hybrid": hybrid, "full_attention": full,
            "ratio": hybrid["peak_bytes"] / full["peak_bytes"]}


def most_without_preempting(shape: Shape, hybrid: bool, pool_bytes: int) -> int:
    """The largest max_num_seqs at which as many sequences all run at once, none preempted."""
    low, high = 0, 1
    while _runs_clean(shape, hybrid, pool_bytes, high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if _runs_clean(shape, hybrid, pool_bytes, middle) \
            else (low, middle)
    return low


def _runs_clean(shape: Shape, hybrid: bool, pool_bytes: int, k: int) -> bool:
    result = run(shape, hybrid, pool_bytes, k, k)
    return result["preemptions"] == 0 and result["failed"] == 0 and result["peak_running"] == k


def concurrency_ratio(shape: Shape, pool_bytes: int) -> dict:
    hybrid = most_without_preempting(shape, True, pool_bytes)
    full = most_without_preempting(shape, False, pool_bytes)
    return {"pool_bytes": pool_bytes, "hybrid": hybrid, "full_attention": full,
            "ratio": hybrid / full if full else float("inf")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="divide lengths and window by this")
    args = parser.parse_args()
    shape = Shape() if args.scale == 1 else Shape().scaled(args.scale)
    full_bytes = kv_bytes_per_token(len(shape.windows), KV_HEADS, HEAD_DIM, DTYPE)
    # The 1 GiB budget scaled with the sequences, so the same number of them fits.
    budget = 2**30 if args.scale == 1 else 2**30 // args.scale
    print(json.dumps({"shape": {"windows": sorted(set(shape.windows)), "layers": len(shape.windows),
                                "seq_len": shape.seq_len, "block_size": shape.block_size,
                                "chunk": shape.chunk, "full_bytes_per_token": full_bytes},
                      "peak_16": peak_ratio(shape), "concurrency": concurrency_ratio(shape, budget)},
                     indent=1))


if __name__ == "__main__":
    main()
