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

N_BATCH = 512     # llama.cpp's prompt batch (its default n_batch)
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
    import llama_cpp
    import numpy as np

    request = read_request()
    prompts, max_tokens = request["prompts"], request["max_tokens"]
    llama_cpp.llama_backend_init()
    quiet = llama_cpp.llama_log_callback(lambda *_: None)  # kept alive: llama.cpp calls it
    llama_cpp.llama_log_set(quiet, None)
    model = llama_cpp.llama_model_load_from_file(request["path"].encode(),
                                                 llama_cpp.llama_model_default_params())
    # The low-level context: Llama() has no n_seq_max. A KV stream per sequence (kv_unified
    # off), as llama.cpp advises for sequences that share no prefix: with one unified cache
    # every token attends over all sequences' cells under a mask (w64, default model, AMD
    # EPYC, 2 threads, 2026-12-02: 39.9 tok/s unified, 58.1 with a stream per sequence).
    params = llama_cpp.llama_context_default_params()
    per_sequence = max(len(p) + m for p, m in zip(prompts, max_tokens)) + 8
    params.n_ctx = per_sequence * len(prompts)
    params.n_batch = params.n_ubatch = N_BATCH
    params.n_seq_max, params.kv_unified = len(prompts), False
    params.n_threads = params.n_threads_batch = request["threads"]
    ctx = llama_cpp.llama_init_from_model(model, params)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(max(N_BATCH, len(prompts)), 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """(token, position, sequence, wants logits) -> argmax of each wanted row."""
        batch.n_tokens = len(entries)
        for i, (token, position, seq, wanted) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = seq, wanted
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i),
                                                     shape=(n_vocab,))))
                for i, entry in enumerate(entries) if entry[3]]

    def one_run(count: int) -> tuple[float, list[list[int]]]:
        count = min(count, len(prompts))
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        start = time.perf_counter()
        outputs: list[list[int]] = [[] for _ in prompts[:count]]
        pending = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts[:count])
                   for pos, t in enumerate(p)]
        firsts = []
        for at in range(0, len(pending), N_BATCH):
            firsts += decode(pending[at:at + N_BATCH])
        for s, token in enumerate(firsts):
            outputs[s].append(token)
        while live := [s for s in range(count) if len(outputs[s]) < max_tokens[s]]:
            tokens = decode([(outputs[s][-1], len(prompts[s]) + len(outputs[s]) - 1, s, True)
                             for s in live])
            for s, token in zip(live, tokens):
                outputs[s].append(token)
        return time.perf_counter() - start, outputs

    one_run(WARM_UP)
    runs = [one_run(len(prompts)) for _ in range(request["repeats"])]
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
        path = model_path(name)
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
