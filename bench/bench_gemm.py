"""The skinny bf16 GEMMs of a decode step, side by side: our packed-weight kernel (AMX, AVX-512
BF16 or AVX2, whichever this CPU runs), oneDNN on a pre-packed weight (what pagedgen used where
there is no AMX) and F.linear on the plain weight. On an AVX2 CPU (no bf16 arithmetic: torch's
bf16 GEMMs widen in memory) oneDNN and F.linear run in float32, the dtype they would be run in.

    python bench/bench_gemm.py [--threads 1,2] [--rows 1,8,16,32,64,128,256,512] [--repeats 7]
                               [--shapes qkv,...,qkv_1b,gate_up_1b,down_1b] [--forms]
                               [--copies 16]

Shapes: SmolLM2-135M's projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
and its LM head (49152x576). Every timing is one call as the model makes it (output allocated,
Python wrapper included); the three run in turn within each repeat, medians reported, with
GFLOP/s and the ratios oneDNN/ours and F.linear/ours (> 1: ours faster). The last table gives,
per shape, the largest row count up to which ours beats both (the dispatch crossover).

With one weight, a weight of a few MB stays in the last-level cache from call to call, which a
model's step never sees (each layer has its own); --copies N cycles through N distinct copies of
each weight, so that at 1B shapes every call reads its weight from memory as in the model.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedgen.kernels.cpu import native
from pagedgen.model.runtime.cpu_malloc import keep_freed_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers.cpu_info import cpu_info  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576),
          # Llama-3.2-1B's (not in the default list)
          "qkv_1b": (3072, 2048), "gate_up_1b": (16384, 2048), "down_1b": (2048, 8192)}
KERNELS = {"amx": native.amx_linear, "avx512": native.avx512_linear, "avx2": native.avx2_linear}
MIN_SAMPLE_S = 0.004  # calls per sample so that one sample lasts at least this long


def cycled(copies: list, call):
    """call(x, weight) as a function of x, each call on the next of the copies."""
    turn = itertools.cycle(copies)
    return lambda x: call(x, next(turn))


def contenders(out_features: int, in_features: int, kind: str, forms: bool = False,
               taken: int = 0, copies: int = 1):
    """Each GEMM as a function of x; forms: the AVX-512 kernel's VDPBF16PS-only form too,
    where this CPU takes (`taken` = 1) its float32 form for many rows ("ours" is then that)."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
                ).to(torch.bfloat16) for _ in range(copies)]
    ours_packed = [native.gemm_pack(w) for w in weights]
    kernel = KERNELS[kind]
    peer_weights = [w.float() for w in weights] if kind == "avx2" else weights
    # 64: the model's rows hint
    onednn_packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in peer_weights]

    def in_form(form: int):
        def run(x, packed):
            native.avx512_linear_form(form)
            return kernel(x, packed, out_features)
        return cycled(ours_packed, run)

    fns = {
        "ours": in_form(taken),
        "oneDNN": cycled(onednn_packed, lambda x, packed: torch.ops.mkldnn._linear_pointwise(
            x.to(packed.dtype), packed, None, "none", [], "")),
        "F.linear": cycled(peer_weights, lambda x, w: F.linear(x.to(w.dtype), w)),
    }
    if forms and kind == "avx512" and taken == 1:
        fns["VDPBF16PS"] = in_form(0)
    return fns


def calls_per_sample(fn, x) -> int:
    start = time.perf_counter()
    fn(x)
    once = max(time.perf_counter() - start, 1e-6)
    return max(1, int(MIN_SAMPLE_S / once))


def time_side_by_side(fns: dict, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, the functions taking turns in every repeat."""
    for fn in fns.values():
        fn(x)  # warm-up
    counts = {name: calls_per_sample(fn, x) for name, fn in fns.items()}
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(counts[name]):
                fn(x)
            samples[name].append((time.perf_counter() - start) / counts[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1", help="comma-separated thread counts")
    parser.add_argument("--rows", default="1,8,16,32,64,128,256,512")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--copies", type=int, default=1,
                        help="distinct copies of each weight, taken in turn (weights from "
                             "memory, as in a model, instead of the cache)")
    parser.add_argument("--forms", action="store_true",
                        help="also the AVX-512 kernel's VDPBF16PS form where this CPU takes "
                             "its float32 form for many rows")
    args = parser.parse_args()
    # As the engine does: freed outputs reused, not mapped afresh (a fresh 2048-row output's
    # page faults cost every GEMM here some 5% at large M).
    keep_freed_memory()
    kind = native.gemm_kind()
    if kind is None:
        raise SystemExit("no native GEMM here (needs AMX, AVX-512 BF16 or AVX2 and a C compiler)")
    rows_list = [int(r) for r in args.rows.split(",")]
    taken = native.avx512_linear_form()  # as timed on this CPU, before any call sets it
    if kind == "avx512" and taken:
        wide = native.load().avx512_linear_wide_min_rows()
        kind += f" (float32 FMA form from {wide} rows: VDPBF16PS multiplies slower here)"
    if kind == "avx2":
        kind += " (oneDNN and F.linear in float32: bf16 is emulated here)"
    print(f"{cpu_info().summary()}; our kernel: {kind}; dtype bfloat16; median of {args.repeats}; "
          f"{args.copies} cop{'y' if args.copies == 1 else 'ies'} of each weight; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        print(f"\nthreads {threads}")
        print(f"{'shape':<8} {'N x K':>11} {'M':>4} | {'ours ms':>8} {'oneDNN ms':>9} "
              f"{'F.lin ms':>8} | {'ours GF/s':>9} {'oneDNN':>7} {'F.lin':>7} | "
              f"{'oneDNN/ours':>11} {'F.lin/ours':>10}")
        crossover = {}
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            fns = contenders(n, k, native.gemm_kind(), args.forms, taken, args.copies)
            crossover[name] = 0
            for m in rows_list:
                x = torch.randn(m, k).to(torch.bfloat16)
                t = time_side_by_side(fns, x, args.repeats)
                gflops = {c: 2 * m * n * k / s / 1e9 for c, s in t.items()}
                print(f"{name:<8} {n:>5} x {k:<4} {m:>4} | {t['ours'] * 1e3:8.3f} "
                      f"{t['oneDNN'] * 1e3:9.3f} {t['F.linear'] * 1e3:8.3f} | "
                      f"{gflops['ours']:9.1f} {gflops['oneDNN']:7.1f} {gflops['F.linear']:7.1f} | "
                      f"{t['oneDNN'] / t['ours']:11.2f} {t['F.linear'] / t['ours']:10.2f}",
                      flush=True)
                if "VDPBF16PS" in t:
                    print(f"{'':<26} VDPBF16PS form {t['VDPBF16PS'] * 1e3:8.3f} ms "
                          f"{2 * m * n * k / t['VDPBF16PS'] / 1e9:7.1f} GF/s, "
                          f"it / ours {t['VDPBF16PS'] / t['ours']:5.2f}")
                if t["ours"] <= min(t["oneDNN"], t["F.linear"]) and crossover[name] == m_prev(
                        rows_list, m):
                    crossover[name] = m
        print("ours fastest for every M up to: " +
              ", ".join(f"{name} {m}" for name, m in crossover.items()))


def m_prev(rows_list: list[int], m: int) -> int:
    """The row count before m in the list (0 for the first): the crossover grows only while
    ours stays the fastest at every row count."""
    index = rows_list.index(m)
    return 0 if index == 0 else rows_list[index - 1]


if __name__ == "__main__":
    main()
