"""One suite workload, reduced, through the engine once per projection path, side by side in
one process (the engines take turns in every repeat; medians of the generate wall time and of
the process CPU time, the steadier figure on a shared machine).

    python bench/bench_projection_paths.py [--suite w64] [--fraction 0.125] [--threads 1]

Paths (each an LLM of its own, built with the switch set while it packs its weights):
  onednn  PAGEDGEN_NATIVE_GEMM=0: torch's oneDNN on pre-packed weights, layer by layer
  layers  our GEMM (AMX or AVX-512 BF16), layer by layer (PAGEDGEN_FUSED_DECODE=0)
  fused   our GEMM, pure decode steps in one native call (the default)
No timers are attached: `profile_suite.py`'s instrumented kernels make the engine run its
layers one module at a time, so it cannot show the fused step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.cpu_info import cpu_info  # noqa: E402
from peers.workload import random_workload, suite_specs  # noqa: E402
from profile_suite import scaled  # noqa: E402

PATHS = {"onednn": {"PAGEDGEN_NATIVE_GEMM": "0", "PAGEDGEN_FUSED_DECODE": "0"},
         "layers": {"PAGEDGEN_NATIVE_GEMM": "1", "PAGEDGEN_FUSED_DECODE": "0"},
         "fused": {"PAGEDGEN_NATIVE_GEMM": "1", "PAGEDGEN_FUSED_DECODE": "1"}}


def build(path: str, model: Path, args, kv_bytes: int):
    from pagedgen import LLM

    os.environ.update(PATHS[path])
    llm = LLM(model=str(model), dtype="bfloat16", threads=args.threads, kv_memory=kv_bytes,
              seed=args.seed)
    decoder = llm.engine.runner.model
    kind = getattr(decoder.layers[0].mlp.gate_up_packed, "kind", "F.linear")
    print(f"{path}: projections {kind}, "
          f"{'fused decode' if decoder.fused_decode is not None else 'layer by layer'}", flush=True)
    return llm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="w64", help="one workload of the suite")
    p.add_argument("--fraction", type=float, default=0.125)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--kv-gib", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from transformers import AutoTokenizer

    from make_bench_model import make_bench_model
    from pagedgen import SamplingParams

    model = make_bench_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    token_range = (max(tokenizer.all_special_ids, default=-1) + 1, min(len(tokenizer), vocab))
    spec = scaled(suite_specs(args.suite, False, args.seed)[0], args.fraction)
    workload = random_workload(spec, token_range)
    kv_bytes = workload.kv_bytes or int(args.kv_gib * 2**30)
    print(f"{cpu_info().summary()}; threads {args.threads}; bfloat16; {workload.name}: "
          f"{workload.description}; median of {args.repeats}")
    llms = {path: build(path, model, args, kv_bytes) for path in args.paths.split(",")}
    prompts = [{"prompt_token_ids": ids} for ids in workload.prompts]
    params = [SamplingParams(max_tokens=g, n=workload.n, temperature=workload.temperature,
                             ignore_eos=True) for g in workload.max_tokens]
    walls, cpus = {path: [] for path in llms}, {path: [] for path in llms}
    for _ in range(args.repeats):
        for path, llm in llms.items():
            start, cpu = time.perf_counter(), time.process_time()
            llm.generate(prompts, params, use_tqdm=False)
            walls[path].append(time.perf_counter() - start)
            cpus[path].append(time.process_time() - cpu)
    first = next(iter(llms))
    base_wall, base_cpu = statistics.median(walls[first]), statistics.median(cpus[first])
    for path, times in walls.items():
        wall, cpu = statistics.median(times), statistics.median(cpus[path])
        print(f"{path:<7} generate wall {wall:6.2f} s (runs {', '.join(f'{t:.2f}' for t in times)}), "
              f"{workload.generated_tokens / wall:6.1f} gen tok/s, {base_wall / wall:4.2f}x "
              f"{first} | cpu {cpu:6.2f} s, {base_cpu / cpu:4.2f}x {first}")


if __name__ == "__main__":
    main()
