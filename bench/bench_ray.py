"""1 replica vs 2 replicas on Ray (Ray Data stage), against the single-process engine.

Same model, workload, batch size and threads per replica (1) everywhere:

- single: one process, LLM(threads=1), the prompts in batches of --batch-size, one
  `generate` per batch (what a replica does), after the model is loaded;
- ray-1, ray-2: `build_processor(ProcessorConfig(concurrency=R, batch_size=B))` on a local
  Ray instance (`ray.init(num_cpus=2)`), the dataset consumed as it streams.

Figures: aggregate generated tok/s over the generation window (first replica ready -> last
row back, so model loading is excluded), the 2/1 ratio, Ray's start-up (ray.init; first row
back after execution starts), the per-batch overhead (a replica's span from ready to its
last batch, minus its time inside `generate`, per batch), and tokens per CPU-second of each
replica, summed: what the replicas would give with a free core each (wall-clock scaling is
capped by the cores other processes leave). On a shared 2-core machine every figure is indicative.

    python bench/bench_ray.py                      # default model (SmolLM2-135M), ~5 minutes
    python bench/bench_ray.py --quick --json /tmp/bench_ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass


@dataclass
class RayRun:
    replicas: int
    wall_s: float
    first_row_s: float
    generated_tokens: int
    window_s: float
    tok_per_s: float
    overhead_per_batch_ms: float
    per_replica_busy_tok_s: list[float]
    per_replica_cpu_tok_s: list[float]       # tokens per CPU-second of each replica
    load_average_1min: float


def workload(count: int, prompt_len: int, max_tokens: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": i, "prompt_token_ids": [rng.randrange(100, vocab) for _ in range(prompt_len)],
             "max_tokens": max_tokens} for i in range(count)]


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "device": "cpu", "threads": 1, "kv_memory": 256 << 20,
            "max_num_seqs": args.batch_size}


def load_single(args: argparse.Namespace):
    from pagedgen import LLM

    started = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    return llm, time.perf_counter() - started


def run_single(args: argparse.Namespace, llm, rows: list[dict]) -> dict:
    from pagedgen import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens, started, cpu_started = 0, time.perf_counter(), time.process_time()
    for i in range(0, len(rows), args.batch_size):
        batch = rows[i:i + args.batch_size]
        outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in batch], params,
                               use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return {"generated_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "cpu_tok_per_s": tokens / cpu_seconds,
            "load_average_1min": os.getloadavg()[0]}


def run_ray(args: argparse.Namespace, rows: list[dict], replicas: int) -> RayRun:
    import ray

    from pagedgen.ray_data import ProcessorConfig, build_processor

    config = ProcessorConfig(model=args.model, engine_kwargs=engine_kwargs(args), concurrency=replicas,
                             batch_size=args.batch_size,
                             sampling={"temperature": 0, "ignore_eos": True})
    blocks = -(-len(rows) // args.batch_size)
    dataset = build_processor(config)(ray.data.from_items(rows, override_num_blocks=blocks))
    reports, tokens, first_row, last_row = {}, 0, None, None
    started = time.perf_counter()
    for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
        now = time.time()
        first_row = first_row or time.perf_counter() - started
        last_row = now
        for row in batch.select(["num_generated_tokens", "error", "replica_report"]).to_pylist():
            assert not row["error"], row["error"]
            tokens += row["num_generated_tokens"]
            if row["replica_report"]:
                report = json.loads(row["replica_report"])
                if report["batches"] >= reports.get(report["replica"], {"batches": -1})["batches"]:
                    reports[report["replica"]] = report
    wall = time.perf_counter() - started
    window = last_row - min(r["ready_at"] for r in reports.values())
    # Inside a replica's busy span, the time not spent in generate(): Ray's hand-over of the
    # batch, parsing, tokenizing and building the output table.
    overheads = [(r["last_batch_at"] - r["ready_at"] - r["generate_seconds"]) / r["batches"]
                 for r in reports.values()]
    busy = [r["stats"]["generated_tokens"] / r["generate_seconds"] for r in reports.values()]
    cpu = [r["stats"]["generated_tokens"] / r["generate_cpu_seconds"] for r in reports.values()]
    return RayRun(replicas, wall, first_row, tokens, window, tokens / window,
                  1000 * statistics.median(overheads), busy, cpu, os.getloadavg()[0])


def median_of(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf [default: the built-in model]")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="single, 1 and 2 replicas, interleaved")
    parser.add_argument("--quick", action="store_true", help="16 requests of 16 tokens, 1 round")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.rounds = 16, 16, 1
    # Ray starts its workers at nice 15 (the raylet first); the single-process run is at 0. On
    # a shared machine that alone would decide the comparison, so the replicas get 0 as well.
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray
    import torch

    torch.set_num_threads(1)
    rows = workload(args.requests, args.prompt_len, args.max_tokens, 20000, seed=0)
    llm, load_s = load_single(args)
    started = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    init_s = time.perf_counter() - started
    ray.data.DataContext.get_current().enable_progress_bars = False
    singles, runs = [], {1: [], 2: []}
    for _ in range(args.rounds):
        singles.append(run_single(args, llm, rows))
        print(json.dumps({"single": singles[-1]}), flush=True)
        for replicas in (1, 2):
            runs[replicas].append(run_ray(args, rows, replicas))
            print(json.dumps(asdict(runs[replicas][-1])), flush=True)
    ray.shutdown()
    single = median_of([r["tok_per_s"] for r in singles])
    one, two = (median_of([r.tok_per_s for r in runs[k]]) for k in (1, 2))
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "dtype": args.dtype, "threads_per_replica": 1, "requests": args.requests,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "batch_size": args.batch_size, "rounds": args.rounds, "single_load_s": load_s,
              "ray_init_s": init_s, "single_tok_s": single, "ray_1_tok_s": one, "ray_2_tok_s": two,
              "ratio_2_over_1": two / one, "ray_1_over_single": one / single,
              # Scaling if every replica had its core: the sum of tokens per CPU-second.
              "cpu_tok_s": {"single": median_of([r["cpu_tok_per_s"] for r in singles]),
                            **{k: median_of([sum(r.per_replica_cpu_tok_s) for r in runs[k]])
                               for k in (1, 2)}},
              "first_row_s": {k: median_of([r.first_row_s for r in runs[k]]) for k in (1, 2)},
              "overhead_per_batch_ms": {k: median_of([r.overhead_per_batch_ms for r in runs[k]])
                                        for k in (1, 2)},
              "single_runs": singles, "ray_runs": {k: [asdict(r) for r in v] for k, v in runs.items()}}
    print(f"medians of {args.rounds}: single process {single:.1f} tok/s; 1 replica {one:.1f}, "
          f"2 replicas {two:.1f} tok/s (x{two / one:.2f}); 1 replica / single x{one / single:.2f}; "
          f"ray.init {init_s:.1f} s, first row {result['first_row_s'][1]:.1f} / "
          f"{result['first_row_s'][2]:.1f} s; overhead per batch "
          f"{result['overhead_per_batch_ms'][1]:.0f} / {result['overhead_per_batch_ms'][2]:.0f} ms; "
          f"tokens per CPU-second (summed over replicas): {result['cpu_tok_s']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    sys.exit(main())
