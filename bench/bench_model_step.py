"""One model step of the default model vs its GEMM floor.

    python bench/bench_model_step.py [--dtype bfloat16] [--threads 1] [--repeats 5]

Times (median of --repeats) a decode step of --batch sequences at context --context, and a
prefill of --prefill tokens (one sequence), each through ModelRunner.execute. The floor of a
step is the bare time of the same GEMMs with the same weights and row counts: per layer the
fused QKV, o_proj, fused gate/up and down projections, then the LM head on the sampled rows.
ratio = step / floor: what attention, norms, RoPE, the KV writes and the batch bookkeeping add.
The KV cache holds random values: attention costs the same whatever it reads.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedgen.model.loader import load_model
from pagedgen.model.runner import ModelRunner, ScheduledChunk


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, first-touch of the pages, lazy init
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_floor(model, tokens: int, sampled: int, dtype: torch.dtype) -> callable:
    """The projection + MLP + LM-head GEMMs of one step, nothing else."""
    hidden = torch.randn(tokens, model.config.hidden_size, dtype=dtype)
    inter = torch.randn(tokens, model.config.intermediate_size, dtype=dtype)
    attn_out = torch.randn(tokens, model.config.q_size, dtype=dtype)
    head_rows = hidden[:sampled]

    @torch.inference_mode()
    def run() -> None:
        for layer in model.layers:
            F.linear(hidden, layer.attention.qkv_weight, layer.attention.qkv_bias)
            F.linear(attn_out, layer.attention.o_weight)
            F.linear(hidden, layer.mlp.gate_up_weight)
            F.linear(inter, layer.mlp.down_weight)
        F.linear(head_rows, model.lm_head_weight)
    return run


def decode_batch(batch: int, context: int, block_size: int) -> list[ScheduledChunk]:
    per_seq = -(-(context + 1) // block_size)
    return [ScheduledChunk([100 + s], context, list(range(s * per_seq, (s + 1) * per_seq)), True)
            for s in range(batch)]


def prefill_batch(tokens: int, block_size: int) -> list[ScheduledChunk]:
    ids = torch.randint(100, 40000, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    return [ScheduledChunk(ids, 0, list(range(-(-tokens // block_size))), True)]


def report(name: str, step_s: float, floor_s: float, tokens: int) -> None:
    print(f"{name:<34} step {step_s * 1e3:8.1f} ms   floor {floor_s * 1e3:8.1f} ms   "
          f"ratio {step_s / floor_s:5.2f}   {tokens / step_s:9.0f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, dtype=args.dtype, device="cpu")
    per_seq = -(-(args.context + 1) // args.block_size)
    num_blocks = max(args.batch * per_seq, -(-args.prefill // args.block_size))
    runner = ModelRunner(loaded, args.block_size, num_blocks=num_blocks)
    runner.kv_cache.normal_()
    print(f"model {loaded.name}  dtype {args.dtype}  threads {torch.get_num_threads()}  "
          f"block_size {args.block_size}  repeats {args.repeats} (median)")
    decode = decode_batch(args.batch, args.context, args.block_size)
    report(f"decode batch {args.batch} @ context {args.context}",
           median_seconds(lambda: runner.execute(decode, []), args.repeats),
           median_seconds(gemm_floor(loaded.model, args.batch, args.batch, loaded.dtype), args.repeats),
           args.batch)
    prefill = prefill_batch(args.prefill, args.block_size)
    report(f"prefill {args.prefill} tokens",
           median_seconds(lambda: runner.execute(prefill, []), args.repeats),
           median_seconds(gemm_floor(loaded.model, args.prefill, 1, loaded.dtype), args.repeats),
           args.prefill)


if __name__ == "__main__":
    main()
