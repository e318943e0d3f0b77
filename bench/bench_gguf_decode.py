"""Batch-1 decode of a GGUF file: pagedgen packed, pagedgen dequantized and llama.cpp, side by
side in one run on the same file, prompt ids and threads.

    python bench/bench_gguf_decode.py --models default,gemma-270m --threads 1,2 \
        --llama-python V/bin/python [--new-tokens 128 --repeats 3]

Each engine decodes one sequence greedily after the same 64-token prompt (ids from the
stdlib's LICENSE.txt, tokenized once by pagedgen); decode tok/s = new tokens after the first /
their wall time, the median of --repeats, each repeat in the same loaded engine. pagedgen's
figure is its generate call with max_tokens = N + 1 minus the same call with max_tokens = 1
(the prefill and the first token), so both engines count the same tokens. llama.cpp (see
bench_gguf_perplexity.py for the build) runs in its own interpreter, feeding back its own argmax
token by token through `Llama.eval`. Prints the CPU, pagedgen's GGUF kernel path and llama.cpp's
system info.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "peers"))

from llama_cpp_peer import (  # noqa: E402
    main_or_child, read_request, reply, run_child, system_info_line,
)
PROMPT_TOKENS = 64


def pagedgen_rate(path: Path, prompt: list[int], weights: str, threads: int, new_tokens: int,
                  repeats: int) -> tuple[float, str]:
    """Decode tok/s and the dtype it ran in: "auto", what a user gets (bf16 for packed
    blocks; for the dequantized model bf16 where the CPU multiplies bf16 in hardware, else
    float32, whose GEMM is the faster one there)."""
    from pagedgen import LLM, SamplingParams

    llm = LLM(str(path), weights=weights, dtype="auto", threads=threads, seed=0)

    def timed(tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start

    timed(new_tokens + 1)  # warm-up: kernels built and caches touched
    rates = [new_tokens / (timed(new_tokens + 1) - timed(1)) for _ in range(repeats)]
    return statistics.median(rates), str(llm.loaded.dtype).removeprefix("torch.")


def llama_rate(python: str, path: Path, prompt: list[int], threads: int, new_tokens: int,
               repeats: int) -> dict:
    return run_child(python, __file__, {"path": str(path), "prompt": prompt, "threads": threads,
                                        "new_tokens": new_tokens, "repeats": repeats})


def llama_child() -> None:
    """In llama-cpp-python's interpreter: no torch, no pagedgen."""
    import llama_cpp
    import numpy as np

    request = read_request()
    prompt, new_tokens = request["prompt"], request["new_tokens"]
    llm = llama_cpp.Llama(request["path"], n_ctx=len(prompt) + new_tokens + 8,
                          n_threads=request["threads"], n_threads_batch=request["threads"],
                          verbose=False)

    def one_run() -> float:
        llm.reset()
        llm.eval(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        start = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return new_tokens / (time.perf_counter() - start)

    one_run()  # warm-up
    rates = [one_run() for _ in range(request["repeats"])]
    reply({"rate": statistics.median(rates)})


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from bench_gguf_perplexity import _text, model_path, print_banner, speed_bench_parser

    parser = speed_bench_parser(__doc__, threads="1,2")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()

    from pagedgen.model.loading.tokenizer import load_gguf_tokenizer
    print_banner()
    for name in filter(None, (m.strip() for m in args.models.split(","))):
        path = model_path(name, args.llama_python)
        prompt = load_gguf_tokenizer(path)(_text(), add_special_tokens=False)["input_ids"][:PROMPT_TOKENS]
        for threads in (int(t) for t in args.threads.split(",")):
            runs = {w: pagedgen_rate(path, prompt, w, threads, args.new_tokens, args.repeats)
                    for w in ("packed", "dequantized")}
            rates = {w: rate for w, (rate, _) in runs.items()}
            line = (f"{path.name} threads {threads}: packed ({runs['packed'][1]}) "
                    f"{rates['packed']:.1f} tok/s, dequantized ({runs['dequantized'][1]}) "
                    f"{rates['dequantized']:.1f} "
                    f"(packed/dequantized {rates['packed'] / rates['dequantized']:.2f}x)")
            if args.llama_python:
                llama = llama_rate(args.llama_python, path, prompt, threads, args.new_tokens,
                                   args.repeats)
                line += (f", llama.cpp {llama['version']} {llama['rate']:.1f} "
                         f"(packed/llama.cpp {rates['packed'] / llama['rate']:.2f}x)")
            print(line, flush=True)
    if args.llama_python:
        print(system_info_line(llama), flush=True)


if __name__ == "__main__":
    main_or_child(main, llama_child)
