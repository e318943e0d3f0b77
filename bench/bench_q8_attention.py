"""Decode attention alone over 8-bit KV pools against bf16: a decode step's attention of
--layers layers (each its own pool, so the KV is not cache resident), --batch sequences at
--context tokens, SmolLM2-135M shapes (9 query / 3 kv heads, head_dim 64), plus the machine's
DRAM read bandwidth from a large torch copy_ in the same run.

    python bench/bench_q8_attention.py [--batch 8] [--context 2048] [--layers 30] [--threads 1]
                                       [--contiguous]

Prints per format: median ms for all layers, the K/V bytes the kernels read, GB/s, and that rate
as a share of a read-only stream over 512 MiB (timed in pairs with the attention step).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from pagedgen.kernels.cpu import native
from pagedgen.kernels.kv_quant import kv_format, quantize

FORMATS = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def read_bandwidth_gbs(repeats: int) -> float:
    """copy_ of 512 MiB bf16: bytes read (the write is as large again) per second."""
    src = torch.ones(256 << 20, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), repeats)
    return src.numel() * 2 / ms / 1e6


STREAM = torch.ones(128 << 20, dtype=torch.float32)  # 512 MiB, far beyond any cache


def stream_read_ms() -> float:
    """A float32 sum over STREAM: a read-only stream with almost no arithmetic per byte, the
    same access pattern as decode attention's K/V reads (which never write back)."""
    start = time.perf_counter()
    STREAM.sum()
    return (time.perf_counter() - start) * 1e3


def share_of_stream(step, kv_bytes: int, repeats: int) -> tuple[float, float]:
    """Median over repeats of (attention's read rate / the stream's read rate), each pair timed
    back to back: this VM's memory bandwidth drifts by tens of percent within a minute, so
    only rates measured together compare. Also returns the stream's median GB/s."""
    shares, rates = [], []
    for _ in range(repeats):
        stream_rate = STREAM.numel() * 4 / stream_read_ms() / 1e6
        start = time.perf_counter()
        step()
        attention_rate = kv_bytes / ((time.perf_counter() - start) * 1e3) / 1e6
        shares.append(attention_rate / stream_rate)
        rates.append(stream_rate)
    return sorted(shares)[len(shares) // 2], sorted(rates)[len(rates) // 2]


def make_layer(fmt_name: str, blocks: int, block_size: int, kv_heads: int, dim: int):
    shape = (blocks, block_size, kv_heads, dim)
    if fmt_name == "auto":
        return (torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16),
                None, None)
    fmt = kv_format(fmt_name)
    k, v = torch.randn(shape), torch.randn(shape)
    ks, vs = k.abs().amax(dim=(1, 3)) / fmt.qmax, v.abs().amax(dim=(1, 3)) / fmt.qmax
    return (quantize(k, ks[:, None, :, None], fmt), quantize(v, vs[:, None, :, None], fmt),
            ks.contiguous(), vs.contiguous())


def attention_step(fmt_name: str, args) -> dict:
    per_seq = -(-args.context // args.block_size)
    blocks = args.batch * per_seq
    layers = [make_layer(fmt_name, blocks, args.block_size, args.kv_heads, args.head_dim)
              for _ in range(args.layers)]
    # Scattered blocks, as a pool hands them out after some churn (--contiguous: in order, as
    # a fresh pool hands them out and bench_kv_quant.py --speed has them).
    order = (torch.arange(blocks) if args.contiguous
             else torch.randperm(blocks, generator=torch.Generator().manual_seed(0)))
    tables = order.view(args.batch, per_seq)
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int64)
    q = torch.randn(args.batch, args.q_heads, args.head_dim).to(torch.bfloat16)
    out = torch.empty_like(q)
    scale = args.head_dim ** -0.5

    def step():
        for k, v, ks, vs in layers:
            ok = (native.decode_attention(q, k, v, tables, seq_lens, scale, out) if ks is None
                  else native.decode_attention_q8(q, k, v, ks, vs, tables, seq_lens, scale, out))
            assert ok

    ms = median_ms(step, args.repeats)
    code_bytes = 2 * args.layers * args.batch * args.context * args.kv_heads * args.head_dim
    kv_bytes = code_bytes * (2 if fmt_name == "auto" else 1)
    share, stream = share_of_stream(step, kv_bytes, args.repeats)
    return {"ms": round(ms, 2), "kv_mb": round(kv_bytes / 1e6, 1),
            "gb_per_s": round(kv_bytes / ms / 1e6, 2), "of_stream_read": round(share, 3),
            "stream_read_gb_per_s": round(stream, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--contiguous", action="store_true")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert native.load() is not None, "needs the native kernels (a C compiler)"
    out = {"threads": args.threads, "read_gb_per_s": round(read_bandwidth_gbs(args.repeats), 2)}
    print(f"threads {args.threads}; DRAM: copy_ of 512 MiB reads {out['read_gb_per_s']} GB/s "
          "(and writes as much); per format, of_stream_read: the attention's K/V read rate over "
          "a read-only 512 MiB sum's, timed in pairs (median)")
    for name in args.formats.split(","):
        out[name] = attention_step(name, args)
        print(name, json.dumps(out[name]), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
