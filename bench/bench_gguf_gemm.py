"""Packed GGUF GEMMs (kernels/cpu/gguf) against the bf16 GEMM pagedgen runs on dequantized
weights, per weight type and row count, and decode tok/s of the default model both ways.

    python bench/bench_gguf_gemm.py [--threads 1,2] [--rows 1,2,4,8,16,32,64,128,192,256]
                                    [--shape 3072x576] [--types Q8_0,Q4_1,...] [--decode]
    python bench/bench_gguf_gemm.py --values [--shape 3072x2048] [--types ...]

--values: only the decode of weight rows to bf16 values (what the bf16 tiles do before their
products), ns per weight, one thread: a tile panel's 32 rows decoded over and over into one
output row, so that the rows and the values stay in cache and the call's overhead is spread
over thousands of rows.

Per type and M: int8 kernel (the path dispatched on this CPU, printed), the bf16 tile GEMM
(libraries with AVX-512 BF16, on the tile unit in the amx_bf16 one: bf16 activations from
tiles_min_rows() rows on), the
dequantize + dense GEMM route the model takes from DEQUANTIZE_MIN_ROWS rows on (in bf16, or in
float32 on CPUs without bf16 hardware), and our bf16 GEMM on a pre-dequantized weight (what
weights="dequantized" runs in bf16). Weight GB/s = bytes the weight takes
as stored / time; rows/s = M / time. Medians of --repeats calls; with one thread the
thread's CPU time (immune to a shared machine's descheduling), else wall time. Per type, the
crossovers: the smallest M where the tiles beat the int8 kernel, and where dequantize+GEMM
beats the faster of the two.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from pagedgen.kernels.cpu import gguf as gguf_kernels
from pagedgen.model.layers import quantized_linear as ql
from pagedgen.model.layers.linear import linear, pack_weight
from pagedgen.model.runtime.cpu_malloc import keep_freed_memory

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))
from gguf_blocks import random_blocks  # noqa: E402
from peers.cpu_info import cpu_info  # noqa: E402

TYPES = ("Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q4_0", "Q5_K")


CLOCK = time.perf_counter  # main() picks the thread's CPU clock for one thread


def median_seconds(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = CLOCK()
        call()
        times.append(CLOCK() - start)
    return statistics.median(times)


def bench_type(name: str, n: int, k: int, rows: list[int], threads: int, repeats: int,
               library) -> None:
    kind = T[name]
    if k % gguf_kernels.BLOCK_SHAPES[int(kind)][0]:
        print(f"{name:5} skipped: K={k} is not a whole number of its blocks")
        return
    blocks = random_blocks(kind, n, k, np.random.default_rng(0))
    part = ql.QuantizedPart(int(kind), blocks, None, n)
    weight = ql.QuantizedWeight((part,), k, library)
    dense = ql.dequantized(weight, torch.bfloat16)
    packed_dense = pack_weight(dense)
    crossover = tiles_from = None
    has_tiles = gguf_kernels.has_bf16_tiles(library)
    for m in rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        int8 = median_seconds(lambda: gguf_kernels.gemm(library, int(kind), blocks, k, x,
                                                        threads=threads), repeats)
        tiles = median_seconds(lambda: gguf_kernels.gemm(library, int(kind), blocks, k, x,
                                                         threads=threads, bf16_from_rows=1),
                               repeats) if has_tiles else float("nan")
        deq = median_seconds(lambda: ql.dequantized_linear(x, weight), repeats)
        bf16 = median_seconds(lambda: linear(x, dense, packed=packed_dense), repeats)
        packed_best = min(int8, tiles) if has_tiles else int8
        if crossover is None and deq < packed_best:
            crossover = m
        if tiles_from is None and tiles < int8:
            tiles_from = m
        print(f"{name:5} M={m:4} int8 {int8 * 1e3:8.3f} ms {blocks.nbytes / int8 / 1e9:6.2f} GB/s "
              f"{m / int8:9.0f} rows/s | bf16 tiles {tiles * 1e3:8.3f} ms | dequant+GEMM "
              f"{deq * 1e3:8.3f} ms | bf16 GEMM {bf16 * 1e3:8.3f} ms "
              f"{dense.nbytes / bf16 / 1e9:6.2f} GB/s | best packed / bf16 "
              f"{packed_best / bf16:5.2f}x")
    if has_tiles:
        print(f"{name:5} crossover (bf16 tiles faster than int8 from M=): "
              f"{tiles_from or 'none measured'}")
    print(f"{name:5} crossover (dequant+GEMM faster than the packed kernels from M=): "
          f"{crossover or 'none measured'}")


def bench_values(name: str, k: int, repeats: int, library, rows: int = 32,
                 decodes: int = 4096) -> None:
    kind = T[name]
    if k % gguf_kernels.BLOCK_SHAPES[int(kind)][0]:
        print(f"{name:5} skipped: K={k} is not a whole number of its blocks")
        return
    blocks = random_blocks(kind, rows, k, np.random.default_rng(0))
    row_map = torch.arange(decodes, dtype=torch.int64) % rows
    out = torch.empty(k, dtype=torch.bfloat16)
    call = lambda: library.library.gguf_dequantize_rows(  # noqa: E731
        int(kind), blocks.ctypes.data, blocks.shape[1], row_map.data_ptr(), decodes, k,
        out.data_ptr(), 1, 0, 1)
    seconds = median_seconds(call, repeats)
    print(f"{name:5} K={k}: {seconds / (decodes * k) * 1e9:.4f} ns per weight to bf16 "
          f"({rows} rows in cache, 1 thread)")


def bench_decode(threads: int, tokens: int = 32) -> None:
    from pagedgen import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for weights in ("packed", "dequantized"):
        llm = LLM(weights=weights, dtype="bfloat16", threads=threads, kv_memory=32 << 20)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        runs = []
        for _ in range(3):
            start = CLOCK()
            llm.generate(["The capital of France is"], params, use_tqdm=False)
            runs.append(tokens / (CLOCK() - start))
        print(f"decode batch 1, default model, {weights:11}, threads {threads}: "
              f"{statistics.median(runs):7.1f} tok/s (median of 3 x {tokens} tokens)")
        del llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,192,256")
    parser.add_argument("--shape", default="3072x1024",
                        help="N x K (types whose block does not divide K are skipped)")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--decode", action="store_true", help="also decode tok/s, default model")
    parser.add_argument("--values", action="store_true",
                        help="only the decode of weight rows to bf16 values, one thread")
    args = parser.parse_args()
    keep_freed_memory()  # as the engine does: fresh pages cost more than the GEMMs here
    library = gguf_kernels.best()
    n, k = map(int, args.shape.split("x"))
    print(f"{time.strftime('%Y-%m-%d')} {cpu_info().summary()}")
    print(f"GGUF kernel path: {library.path}; shape N={n} K={k}; bf16 GEMM: pagedgen's packed kernel")
    global CLOCK
    if args.values:
        CLOCK = time.thread_time
        for name in args.types.split(","):
            bench_values(name, k, args.repeats, library)
        return
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        # One thread: its CPU time, which a machine shared with other jobs does not inflate
        # (every kernel then runs on the calling thread); more threads: wall time.
        CLOCK = time.thread_time if threads == 1 else time.perf_counter
        print(f"--- threads {threads} ({'thread CPU time' if threads == 1 else 'wall time'})")
        for name in args.types.split(","):
            bench_type(name, n, k, [int(r) for r in args.rows.split(",")], threads, args.repeats,
                       library)
        if args.decode:
            bench_decode(threads)


if __name__ == "__main__":
    main()
