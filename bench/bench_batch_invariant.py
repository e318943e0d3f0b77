"""Throughput of LLM(batch_invariant=True) against the default path, side by side in one run.

The w64 workload's shape (bench/peers/workload.py: random prompts 32..512 tokens, greedy,
ignore_eos), reduced with --requests/--max-tokens to fit a shared machine. Both engines are
built once; then the modes alternate (A B A B ...) so that machine noise hits both alike.
Prints each repeat and the median ratio; also checks the two modes' greedy tokens agree
where they should be close (share of identical completions, for information).

    python bench/bench_batch_invariant.py --threads 2 --requests 16 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from workload import WorkloadSpec, random_workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    args = parser.parse_args()

    from pagedgen import LLM, SamplingParams

    spec = WorkloadSpec(args.requests, tuple(args.prompt_len), tuple(args.max_tokens))
    engines = {mode: LLM(args.model, dtype="bfloat16", threads=args.threads,
                         enable_prefix_caching=False, batch_invariant=mode == "invariant")
               for mode in ("default", "invariant")}
    vocab = engines["default"].loaded.config.vocab_size
    workload = random_workload(spec, (100, min(vocab, 30_000)))
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(max_tokens=g, temperature=0, ignore_eos=True) for g in workload.max_tokens]
    tokens = workload.prompt_tokens + workload.generated_tokens
    print(f"{workload.description}; {workload.prompt_tokens} prompt + {workload.generated_tokens} "
          f"generated tokens; bfloat16, {args.threads} threads")
    seconds: dict[str, list[float]] = {mode: [] for mode in engines}
    outputs = {}
    for repeat in range(args.repeats):
        for mode, llm in engines.items():
            start = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            seconds[mode].append(time.perf_counter() - start)
            outputs[mode] = [r.outputs[0].token_ids for r in results]
            print(f"repeat {repeat} {mode:9s} {seconds[mode][-1]:7.2f} s  "
                  f"{tokens / seconds[mode][-1]:7.1f} tok/s", flush=True)
    ratios = [i / d for i, d in zip(seconds["invariant"], seconds["default"])]
    same = sum(a == b for a, b in zip(outputs["default"], outputs["invariant"]))
    print(f"median time ratio invariant/default: {statistics.median(ratios):.2f} "
          f"(per repeat: {', '.join(f'{r:.2f}' for r in ratios)}); "
          f"identical greedy completions across modes: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
