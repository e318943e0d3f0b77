"""One model step vs its GEMM floor.

    python bench/bench_model_step.py [--model default] [--dtype bfloat16] [--threads 1] [--repeats 5]
    python bench/bench_model_step.py --paths onednn,layers,fused   # the projection paths, in turn

Times (median of --repeats) a decode step of --batch sequences at context --context, and a
prefill of --prefill tokens (one sequence), each through ModelRunner.execute. The floor of a
step is the bare time of the same GEMMs with the same weights and row counts, on the path the
step takes (the model's packed bf16 weights or GGUF blocks as stored): per layer the fused QKV,
o_proj, fused gate/up and down projections, then the LM head on the sampled rows.
ratio = step / floor: what attention, norms, RoPE, the KV writes and the batch bookkeeping add.
The KV cache holds random values: attention costs the same whatever it reads.
Both wall time and process CPU time are reported: on a machine shared with other work the
CPU-time ratio is the steadier figure (it leaves out the time the process was not scheduled).
--paths runs the same steps once per projection path, one model load each, in this process:
onednn (PAGEDGEN_NATIVE_GEMM=0: torch's oneDNN on pre-packed weights, layer by layer), layers
(our AMX or AVX-512 BF16 kernel, layer by layer: PAGEDGEN_FUSED_DECODE=0) and fused (our kernel,
all decode layers in one native call: the default).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedgen.model.layers.linear import linear
from pagedgen.model.loading.loader import load_model
from pagedgen.model.runtime.runner import ModelRunner, ScheduledChunk
from pagedgen.settings import EngineConfig


@dataclass(slots=True)
class Timing:
    wall_s: float  # median wall-clock seconds
    cpu_s: float  # median process CPU seconds


def median_timing(fn, repeats: int) -> Timing:
    fn()  # warm-up: allocator, first-touch of the pages, lazy init
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return Timing(statistics.median(walls), statistics.median(cpus))


def gemm_floor(model, tokens: int, sampled: int, dtype: torch.dtype) -> callable:
    """The projection + MLP + LM-head GEMMs of one step, nothing else, through the same
    `linear` as the model (a GGUF model's weight tensors are placeholders: its matrices are
    the packed blocks)."""
    hidden = torch.randn(tokens, model.config.hidden_size, dtype=dtype)
    inter = torch.randn(tokens, model.config.intermediate_size, dtype=dtype)
    attn_out = torch.randn(tokens, model.config.q_size, dtype=dtype)
    head_rows = hidden[:sampled]

    @torch.inference_mode()
    def run() -> None:
        for layer in model.layers:
            attention, mlp = layer.attention, layer.mlp
            linear(hidden, attention.qkv_weight, attention.qkv_bias, attention.qkv_packed)
            linear(attn_out, attention.o_weight, attention.o_bias, attention.o_packed)
            linear(hidden, mlp.gate_up_weight, packed=mlp.gate_up_packed)
            linear(inter, mlp.down_weight, packed=mlp.down_packed)
        linear(head_rows, model.lm_head_weight, packed=model.lm_head_packed)
    return run


def decode_batch(batch: int, context: int, block_size: int) -> list[ScheduledChunk]:
    per_seq = -(-(context + 1) // block_size)
    return [ScheduledChunk([100 + s], context, list(range(s * per_seq, (s + 1) * per_seq)), True)
            for s in range(batch)]


def prefill_batch(tokens: int, block_size: int) -> list[ScheduledChunk]:
    ids = torch.randint(100, 40000, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    return [ScheduledChunk(ids, 0, list(range(-(-tokens // block_size))), True)]


def report(name: str, step: Timing, floor: Timing, tokens: int) -> None:
    print(f"{name:<32} wall: step {step.wall_s * 1e3:7.1f} ms floor {floor.wall_s * 1e3:7.1f} ms "
          f"ratio {step.wall_s / floor.wall_s:4.2f} ({tokens / step.wall_s:6.0f} tok/s) | "
          f"cpu: step {step.cpu_s * 1e3:7.1f} ms floor {floor.cpu_s * 1e3:7.1f} ms "
          f"ratio {step.cpu_s / floor.cpu_s:4.2f}")


PATHS = {"onednn": {"PAGEDGEN_NATIVE_GEMM": "0", "PAGEDGEN_FUSED_DECODE": "0"},
         "layers": {"PAGEDGEN_NATIVE_GEMM": "1", "PAGEDGEN_FUSED_DECODE": "0"},
         "fused": {"PAGEDGEN_NATIVE_GEMM": "1", "PAGEDGEN_FUSED_DECODE": "1"}}


def projection_path(model) -> str:
    """What this model's projections and decode layers run on."""
    kind = getattr(model.layers[0].mlp.gate_up_packed, "kind", "F.linear")
    return f"{kind}, {'fused decode' if model.fused_decode is not None else 'layer by layer'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default",
                        help="'default' (the SmolLM2 GGUF, blocks as stored), a bench shape "
                             "('bench', 'llama-1b'), 'gemma-270m', or a model folder or .gguf")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paths", default="", help="comma-separated: " + ", ".join(PATHS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for path in filter(None, args.paths.split(",")):
        if path not in PATHS:
            raise SystemExit(f"--paths: unknown path {path!r} (choose from {', '.join(PATHS)})")
        os.environ.update(PATHS[path])
        print(f"--- path {path}")
        run_steps(args)
    if not args.paths:
        run_steps(args)


def model_path(choice: str) -> str | None:
    """--model as load_model takes it: None for the built-in default."""
    if choice == "default":
        return None
    if Path(choice).is_file() or (Path(choice) / "config.json").is_file():
        return choice  # a .gguf file or a model folder
    from make_bench_model import resolve_model  # the bench's shapes, made once

    return str(resolve_model(choice))


def run_steps(args) -> None:
    loaded = load_model(model_path(args.model), dtype=args.dtype, device="cpu")
    per_seq = -(-(args.context + 1) // args.block_size)
    num_blocks = max(args.batch * per_seq, -(-args.prefill // args.block_size))
    runner = ModelRunner(loaded, EngineConfig(block_size=args.block_size, num_blocks=num_blocks))
    runner.kv_cache.normal_()
    print(f"model {loaded.name}  dtype {args.dtype}  threads {torch.get_num_threads()}  "
          f"block_size {args.block_size}  repeats {args.repeats} (median)  "
          f"projections: {projection_path(loaded.model)}")
    decode = decode_batch(args.batch, args.context, args.block_size)
    report(f"decode batch {args.batch} @ context {args.context}",
           median_timing(lambda: runner.execute(decode, []), args.repeats),
           median_timing(gemm_floor(loaded.model, args.batch, args.batch, loaded.dtype), args.repeats),
           args.batch)
    prefill = prefill_batch(args.prefill, args.block_size)
    report(f"prefill {args.prefill} tokens",
           median_timing(lambda: runner.execute(prefill, []), args.repeats),
           median_timing(gemm_floor(loaded.model, args.prefill, 1, loaded.dtype), args.repeats),
           args.prefill)


if __name__ == "__main__":
    main()
