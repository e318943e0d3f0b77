"""Time paged attention: decode (batch 64, context ~300) and prefill (2048 tokens).

Also (CPU, bf16) one prefill chunk of 512 queries at the end of a 6000-token context: the native
prefill kernel this CPU dispatches to (AMX or AVX-512 BF16) against the gather + SDPA fallback,
median ms of each and their ratio (`--cases chunk` runs only this one).

SmolLM2-135M shape: 9 query heads, 3 kv heads, head_dim 64, block size 16.
CPU: cpu_backend (with a per-step plan, and the plan's own cost). CUDA: cpu_backend and the
Triton kernels, with achieved K/V bandwidth (bytes of K/V read / time).

    python bench/bench_attention.py [--threads 1] [--iters 20] [--device cpu|cuda]
                                    [--cases all|chunk]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedgen.kernels import cpu_backend, native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from paged_batch import PagedBatch, make_paged_batch  # noqa: E402  (a test helper)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def decode_batch(dtype: torch.dtype, device: str) -> PagedBatch:
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(250, 351, (64,), generator=gen).tolist()  # context ~300
    return make_paged_batch(seq_lens, [1] * 64, num_q_heads=NUM_Q_HEADS,
                            num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                            block_size=BLOCK_SIZE, dtype=dtype, device=device)


def prefill_batch(dtype: torch.dtype, device: str) -> PagedBatch:
    return make_paged_batch([2048], [2048], num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS,
                            head_dim=HEAD_DIM, block_size=BLOCK_SIZE, dtype=dtype, device=device)


def chunk_batch() -> PagedBatch:
    return make_paged_batch([6000], [512], num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS,
                            head_dim=HEAD_DIM, block_size=BLOCK_SIZE, dtype=torch.bfloat16)


def median_ms(fn: Callable[[], object], iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def bench_prefill_chunk(iters: int) -> None:
    """Native prefill kernel vs gather + SDPA, side by side on one chunk over a cached context."""
    batch = chunk_batch()
    scale = HEAD_DIM ** -0.5
    args = batch.attention_args()
    plan = cpu_backend.plan_attention(*args[3:], BLOCK_SIZE)
    kernel = native.prefill_attention_path(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM)
    native_ms = median_ms(lambda: cpu_backend.paged_attention(*args, scale, plan=plan), iters)
    dispatch = native.prefill_attention
    native.prefill_attention = lambda *a: False  # the fallback cpu_backend runs without it
    try:
        sdpa_ms = median_ms(lambda: cpu_backend.paged_attention(*args, scale, plan=plan), iters)
    finally:
        native.prefill_attention = dispatch
    name = "prefill chunk 512/6000 bf16"
    print(f"{name:28s} {kernel:12s} {native_ms:8.1f} ms   gather+SDPA {sdpa_ms:8.1f} ms   "
          f"ratio {sdpa_ms / native_ms:5.2f}x (median of {iters})")


def time_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    fn()  # warm-up (Triton compiles here)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def kv_bytes_read(batch: PagedBatch) -> int:
    """K and V bytes a paged kernel must read: every context token, every kv head."""
    tokens = int(batch.seq_lens.sum())
    return 2 * tokens * NUM_KV_HEADS * HEAD_DIM * batch.k_cache.element_size()


def bench_case(name: str, batch: PagedBatch, iters: int, device: str) -> None:
    scale = HEAD_DIM ** -0.5
    args = batch.attention_args()
    plan_ms = time_ms(lambda: cpu_backend.plan_attention(*args[3:], BLOCK_SIZE), iters, device)
    plan = cpu_backend.plan_attention(*args[3:], BLOCK_SIZE)
    torch_ms = time_ms(lambda: cpu_backend.paged_attention(*args, scale, plan=plan), iters, device)
    print(f"{name:28s} cpu_backend {torch_ms:8.3f} ms/call   plan {plan_ms:6.3f} ms/step")
    if device == "cuda":
        from pagedgen.kernels import triton_ops
        triton_plan = triton_ops.plan_attention(*args[3:], BLOCK_SIZE)
        triton_ms = time_ms(lambda: triton_ops.paged_attention(*args, scale, plan=triton_plan),
                            iters, device)
        gbps = kv_bytes_read(batch) / (triton_ms * 1e-3) / 1e9
        print(f"{name:28s} triton    {triton_ms:8.3f} ms/call   K/V read {gbps:7.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", choices=("all", "chunk"), default="all")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    print(f"device={opts.device} torch threads={torch.get_num_threads()} iters={opts.iters}")
    if opts.device == "cpu":
        bench_prefill_chunk(opts.iters)
    if opts.cases == "chunk":
        return
    for dtype in (torch.bfloat16, torch.float32):
        tag = str(dtype).removeprefix("torch.")
        bench_case(f"decode B=64 ctx~300 {tag}", decode_batch(dtype, opts.device), opts.iters,
                   opts.device)
        bench_case(f"prefill 2048 {tag}", prefill_batch(dtype, opts.device), opts.iters,
                   opts.device)


if __name__ == "__main__":
    main()
