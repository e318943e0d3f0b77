"""The w64 workload on a GGUF file: pagedgen packed, pagedgen dequantized and llama.cpp's batch
API with 64 parallel sequences, side by side in one run, same file, token ids and threads.

    python bench/bench_gguf_batch.py --models default,gemma-270m --threads 2 \
        --llama-python V/bin/python [--repeats 3]

The workload is bench_peers.py's w64 (64 requests, random ids, prompts 32..512, max_tokens
16..256, greedy, seed 0). Throughput = generated tokens / wall time of the whole workload,
prefill included, the median of --repeats in one loaded engine after an untimed run of the
first four requests. pagedgen runs it as one `generate` call (continuous batching). llama.cpp (built as in
bench_gguf_perplexity.py) runs the loop of its `batched` example over `llama_decode`, in its
own interpreter: every prompt in batches of n_batch tokens, each in its own sequence (a KV
stream of its own), then one token per live sequence per call, each the argmax of its logits
row, until that sequence's max_tokens. Also prints how many requests' greedy tokens agree
between the engines (bf16 against llama.cpp's own arithmetic: a few diverge on random ids).
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "peers"))

from llama_cpp_peer import (  # noqa: E402
    main_or_child, read_request, reply, run_child, system_info_line,
)

WARM_UP = 4       # requests of the untimed first run (both engines)


def workload(path: Path, seed: int):
    from peers.workload import FULL, random_workload

    from pagedgen.model.loading.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(path)
    low = max(tokenizer.all_special_ids, default=-1) + 1
    return random_workload(replace(FULL, seed=seed), (low, len(tokenizer)))


def pagedgen_run(path: Path, weights: str, threads: int, prompts: list[list[int]],
                 max_tokens: list[int], repeats: int) -> tuple[float, list[list[int]]]:
    from pagedgen import LLM, SamplingParams

    llm = LLM(str(path), weights=weights, dtype="bfloat16", threads=threads, seed=0,
              max_num_seqs=len(prompts))
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    items = [{"prompt_token_ids": p} for p in prompts]

    def timed(count: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outputs = llm.generate(items[:count], params[:count], use_tqdm=False)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]

    timed(WARM_UP)  # kernels built, the weights' pages touched
    runs = [timed(len(items)) for _ in range(repeats)]
    return sum(max_tokens) / statistics.median(t for t, _ in runs), runs[-1][1]


def llama_child() -> None:
    """In llama-cpp-python's interpreter: no torch, no pagedgen."""
    from llama_cpp_batch import LlamaBatch

    request = read_request()
    prompts, max_tokens = request["prompts"], request["max_tokens"]
    batch = LlamaBatch(request["path"], prompts, max_tokens, request["threads"])
    batch.run(WARM_UP)
    runs = [batch.run(len(prompts)) for _ in range(request["repeats"])]
    reply({"rate": sum(max_tokens) / statistics.median(t for t, _ in runs),
           "tokens": runs[-1][1]})


def agreeing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def main() -> None:
    from bench_gguf_perplexity import model_path, print_banner, speed_bench_parser

    parser = speed_bench_parser(__doc__, threads="2")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    args = parser.parse_args()
    print_banner()
    llama = None
    for name in filter(None, (m.strip() for m in args.models.split(","))):
        path = model_path(name, args.llama_python)
        work = workload(path, args.seed)
        print(f"{path.name}: {work.description}", flush=True)
        for threads in (int(t) for t in args.threads.split(",")):
            runs = {w: pagedgen_run(path, w, threads, work.prompts, work.max_tokens, args.repeats)
                    for w in ("packed", "dequantized")}
            rate = {w: r for w, (r, _) in runs.items()}
            line = (f"  threads {threads}: packed {rate['packed']:.1f} tok/s, dequantized "
                    f"{rate['dequantized']:.1f} (packed/dequantized "
                    f"{rate['packed'] / rate['dequantized']:.2f}x)")
            agree = (f"  greedy agreement, requests of {len(work.prompts)}: packed~dequantized "
                     f"{agreeing(runs['packed'][1], runs['dequantized'][1])}")
            if args.llama_python:
                llama = run_child(args.llama_python, __file__,
                                  {"path": str(path), "prompts": work.prompts,
                                   "max_tokens": work.max_tokens, "threads": threads,
                                   "repeats": args.repeats})
                line += (f", llama.cpp {llama['version']} batch API {llama['rate']:.1f} "
                         f"(packed/llama.cpp {rate['packed'] / llama['rate']:.2f}x)")
                agree += f", packed~llama.cpp {agreeing(runs['packed'][1], llama['tokens'])}"
            print(line + "\n" + agree, flush=True)
    if llama is not None:
        print(system_info_line(llama), flush=True)


if __name__ == "__main__":
    main_or_child(main, llama_child)
