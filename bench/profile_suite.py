"""Where pagedgen's time goes on each workload of the suite, at a reduced scale, in one process.

Timers are attached from outside (pagedgen.cli.profile.instrument for the engine phases, plus
wrappers around the projection GEMMs), so the engine runs its normal code:

- GEMMs            the dense projections and the LM head (`linear`, `linear_float32`)
- attention        the kernel module's store_kv / plan_attention / paged_attention
- sampling         the Sampler call
- scheduler+Python the scheduler, the engine's per-step bookkeeping (sampler batch, appending
                   tokens, stop checks, freeing, memory tracker) and LLM.generate around steps
- other forward    the rest of the forward: embedding, norms, RoPE, SiLU, batch metadata

The attention timers wrap the kernel module, and the one-call decode step (fused decode, on
AMX and AVX-512 BF16 CPUs) runs only on the bare module: profiled runs take the layers one
module at a time, which splits the time but leaves out the fused step's saving
(bench_projection_paths.py measures that, untimed). PAGEDGEN_NATIVE_GEMM=0 puts the projections
back on torch's oneDNN, the path before our AVX-512 BF16 GEMM.

    python bench/profile_suite.py --suite all --fraction 0.25 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from peers.workload import random_workload, scaled, suite_specs  # noqa: E402

CATEGORIES = ("GEMMs", "attention", "sampling", "scheduler+Python", "other forward")


class GemmTimer:
    """Wraps the projection functions where the model modules imported them."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def install(self) -> None:
        from pagedgen.model.layers import attention, decoder, norm_mlp

        for module, name in ((attention, "linear"), (norm_mlp, "linear"), (decoder, "linear_float32")):
            setattr(module, name, self.wrap(getattr(module, name)))


def profile_one(workload, model: str, args, gemm: GemmTimer) -> dict:
    from pagedgen import LLM, SamplingParams
    from pagedgen.cli.profile import instrument

    kv = workload.kv_bytes or int(args.kv_gib * 2**30)
    start = time.perf_counter()
    llm = LLM(model=model, dtype=args.dtype, threads=args.threads, kv_memory=kv, seed=workload.seed)
    startup = time.perf_counter() - start
    timer = instrument(llm)
    gemm.seconds = 0.0
    params = [SamplingParams(max_tokens=g, n=workload.n, temperature=workload.temperature,
                             ignore_eos=True) for g in workload.max_tokens]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    t = timer.totals
    parts = {
        "GEMMs": gemm.seconds,
        "attention": t["attention"],
        "sampling": t["sampling"],
        "scheduler+Python": t["scheduling"] + (t["step"] - t["scheduling"] - t["forward"] - t["sampling"])
                            + (wall - t["step"]),
        "other forward": t["forward"] - t["attention"] - gemm.seconds,
    }
    return {"workload": workload.name, "description": workload.description, "wall_s": wall,
            "startup_s": startup, "steps": timer.steps, "generated_tokens": workload.generated_tokens,
            "preemptions": llm.memory_report()["summary"]["preemptions"], "seconds": parts}


def markdown(rows: list[dict]) -> str:
    lines = ["| workload | wall s | steps | " + " | ".join(CATEGORIES) + " |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in CATEGORIES) + " |"]
    for row in rows:
        shares = " | ".join(f"{100 * row['seconds'][c] / row['wall_s']:.0f}%" for c in CATEGORIES)
        lines.append(f"| {row['workload']} | {row['wall_s']:.1f} | {row['steps']} | {shares} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="all")
    p.add_argument("--fraction", type=float, default=0.25, help="share of each workload's requests")
    p.add_argument("--model", default="bench",
                   help="'bench', 'llama-1b', 'gemma-270m', 'default' or a model folder")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not 0 < args.fraction <= 1:
        raise SystemExit(f"--fraction must be in (0, 1], got {args.fraction}")

    from transformers import AutoTokenizer

    from make_bench_model import resolve_model

    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    token_range = (max(tokenizer.all_special_ids, default=-1) + 1, min(len(tokenizer), vocab))
    gemm = GemmTimer()
    gemm.install()
    rows = []
    for spec in suite_specs(args.suite, False, args.seed):
        workload = random_workload(scaled(spec, args.fraction), token_range)
        rows.append(profile_one(workload, str(model), args, gemm))
        row = rows[-1]
        print(f"{row['workload']}: {row['description']}; wall {row['wall_s']:.1f} s, start-up "
              f"{row['startup_s']:.1f} s, {row['steps']} steps, preemptions {row['preemptions']}, "
              + ", ".join(f"{c} {s:.2f} s" for c, s in row["seconds"].items()), flush=True)
    print(f"\nthreads {args.threads}, dtype {args.dtype}, fraction {args.fraction:g} of each workload's requests")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
