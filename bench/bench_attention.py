"""Time paged attention: decode (batch 64, context ~300) and prefill (2048 tokens).

Also (CPU, bf16) one prefill chunk of 512 queries at the end of a 6000-token context: the native
prefill kernel this CPU dispatches to (AMX or AVX-512 BF16) against the gather + SDPA fallback,
median ms of each and their ratio (`--cases chunk` runs only this one). `--kv-dtypes int8,...`
adds the chunk over 8-bit pools of the same values (native kernel on the codes, and gather +
dequantize + SDPA), timed round-robin with the bf16 pool's, each against bf16's native kernel.
On CPU, also each bf16 decode-attention kernel the CPU can run (the fastest it has, AVX2, the
portable loop) on the decode batch, round-robin (`--cases decode` runs only this one).

SmolLM2-135M shape: 9 query heads, 3 kv heads, head_dim 64, block size 16; `--heads 32,8,64`
(Llama-3.2-1B) or `--heads 4,1,256` (Gemma 3 270M) for others.
CPU: cpu_backend (with a per-step plan, and the plan's own cost). CUDA: cpu_backend and the
Triton kernels, with achieved K/V bandwidth (bytes of K/V read / time).

    python bench/bench_attention.py [--threads 1] [--iters 20] [--device cpu|cuda]
                                    [--cases all|chunk|decode] [--kv-dtypes int8,fp8_e4m3,fp8_e5m2]
                                    [--heads 9,3,64]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedgen.kernels.cpu import backend as cpu_backend

from pagedgen.kernels.cpu import native
from pagedgen.kernels.kv_quant import kv_format, quantize

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


def interleaved_medians(fns: dict[str, Callable[[], object]], iters: int) -> dict[str, float]:
    """Median ms of each function, run round-robin (one call of each per round): on a shared
    machine a load change then hits every variant alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}


def quantized_pool(batch: PagedBatch, name: str):
    """The batch's K/V as the codes of `name` with per block and KV head scales."""
    fmt = kv_format(name)
    pools = []
    for values in (batch.k_cache.float(), batch.v_cache.float()):
        scales = values.abs().amax(dim=(1, 3)) / fmt.qmax  # [N, H_kv]
        pools.append((quantize(values, scales[:, None, :, None], fmt), scales))
    (k, k_scales), (v, v_scales) = pools
    return k, v, k_scales, v_scales


def bench_prefill_chunk(iters: int, kv_dtypes: list[str]) -> None:
    """Native prefill kernel vs gather + SDPA, side by side on one chunk over a cached context;
    on 8-bit pools too with kv_dtypes."""
    batch = chunk_batch()
    scale = HEAD_DIM ** -0.5
    args = batch.attention_args()
    plan = cpu_backend.plan_attention(*args[3:], BLOCK_SIZE)
    kernel = native.prefill_attention_path(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM)
    dispatch = {"bf16": native.prefill_attention, "q8": native.prefill_attention_q8}

    timed_form = native.prefill_attention_form()

    def timed(fn, path_on: bool, form: int = timed_form):
        def run():
            native.prefill_attention = dispatch["bf16"] if path_on else lambda *a: False
            native.prefill_attention_q8 = dispatch["q8"] if path_on else lambda *a: False
            native.prefill_attention_form(form)
            fn()
        return run

    bf16_chunk = lambda: cpu_backend.paged_attention(*args, scale, plan=plan)  # noqa: E731
    fns = {("auto", on): timed(bf16_chunk, on) for on in (True, False)}
    if kernel.startswith("AVX-512 BF16"):  # both forms, whichever this CPU takes
        fns[("other form", True)] = timed(bf16_chunk, True, 1 - timed_form)
    for name in kv_dtypes:
        k, v, ks, vs = quantized_pool(batch, name)
        q_args = (args[0], k, v, *args[3:], scale)
        for path_on in (True, False):
            fns[(name, path_on)] = timed(
                lambda q_args=q_args, ks=ks, vs=vs: cpu_backend.paged_attention(
                    *q_args, plan=plan, k_scales=ks, v_scales=vs), path_on)
    try:
        ms = interleaved_medians(fns, iters)
    finally:
        native.prefill_attention, native.prefill_attention_q8 = dispatch["bf16"], dispatch["q8"]
        native.prefill_attention_form(timed_form)
    bf16_native = ms[("auto", True)]
    print(f"prefill chunk 512/6000, heads {NUM_Q_HEADS}/{NUM_KV_HEADS} x {HEAD_DIM}, {kernel}, "
          f"median of {iters} (round-robin):")
    if ("other form", True) in ms:
        other = ms[("other form", True)]
        names = ("VDPBF16PS", "float32 FMA")
        print(f"  forms     {names[timed_form]} (taken) {bf16_native:8.1f} ms   "
              f"{names[1 - timed_form]} {other:8.1f} ms   other/taken {other / bf16_native:5.2f}x")
    for name in ["auto", *kv_dtypes]:
        fast, slow = ms[(name, True)], ms[(name, False)]
        label = "bf16" if name == "auto" else name
        print(f"  {label:9s} native {fast:8.1f} ms   gather+SDPA {slow:8.1f} ms   "
              f"gather/native {slow / fast:5.2f}x   "
              f"native vs bf16 native {bf16_native / fast:5.2f}x")


def bench_decode_kernels(iters: int) -> None:
    """Each bf16 decode-attention kernel this CPU can run on the decode batch, round-robin."""
    batch = decode_batch(torch.bfloat16, "cpu")
    args = batch.attention_args()
    plan = cpu_backend.plan_attention(*args[3:], BLOCK_SIZE)
    scale = HEAD_DIM ** -0.5
    taken = native.decode_kernel()

    def on(kernel: str) -> Callable[[], object]:
        def run():
            native.decode_kernel(kernel)
            cpu_backend.paged_attention(*args, scale, plan=plan)
        return run

    try:
        ms = interleaved_medians({kernel: on(kernel) for kernel in native.DECODE_KERNELS}, iters)
    finally:
        native.decode_kernel(taken)
    gbps = {kernel: kv_bytes_read(batch) / (t * 1e-3) / 1e9 for kernel, t in ms.items()}
    print(f"decode B=64 ctx~300 bf16, heads {NUM_Q_HEADS}/{NUM_KV_HEADS} x {HEAD_DIM}, "
          f"median of {iters} (round-robin; \"fastest\" is what this CPU takes):")
    for kernel, t in ms.items():
        print(f"  {kernel:9s} {t:8.3f} ms   K/V read {gbps[kernel]:6.1f} GB/s   "
              f"portable/this {ms['portable'] / t:5.2f}x")


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
        from pagedgen.kernels.triton import ops as triton_ops
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
    parser.add_argument("--cases", choices=("all", "chunk", "decode"), default="all")
    parser.add_argument("--kv-dtypes", default="", help="8-bit pools for the prefill chunk too, "
                        "comma-separated (int8, fp8_e4m3, fp8_e5m2)")
    parser.add_argument("--heads", default="9,3,64",
                        help="query heads, kv heads, head_dim (the model's attention shape)")
    opts = parser.parse_args()
    global NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM
    NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = map(int, opts.heads.split(","))
    torch.set_num_threads(opts.threads)
    print(f"device={opts.device} torch threads={torch.get_num_threads()} iters={opts.iters}")
    if opts.device == "cpu":
        kv_dtypes = [name for name in opts.kv_dtypes.split(",") if name]
        for name in kv_dtypes:
            kv_format(name)  # a bad name fails here, naming the choices
        if opts.cases in ("all", "decode"):
            bench_decode_kernels(opts.iters)
        if opts.cases in ("all", "chunk"):
            bench_prefill_chunk(opts.iters, kv_dtypes)
    if opts.cases != "all":
        return
    for dtype in (torch.bfloat16, torch.float32):
        tag = str(dtype).removeprefix("torch.")
        bench_case(f"decode B=64 ctx~300 {tag}", decode_batch(dtype, opts.device), opts.iters,
                   opts.device)
        bench_case(f"prefill 2048 {tag}", prefill_batch(dtype, opts.device), opts.iters,
                   opts.device)


if __name__ == "__main__":
    main()
