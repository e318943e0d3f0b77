"""Runner: pagedgen through its Python API (`from pagedgen import LLM, SamplingParams`)."""

from __future__ import annotations

import time

PROCESS_START = time.time()

from collections import Counter  # noqa: E402

from common import (  # noqa: E402
    RunnerResult, check_args, check_outputs, env_threads, finish, load_workload, runner_args,
    seconds_since_spawn,
)


def kernel_paths(llm) -> list[str]:
    """The compute paths pagedgen dispatched to on this CPU (what start-up packing and the
    native library's checks chose), so that a figure can be read with the path behind it."""
    import torch

    from pagedgen.kernels.cpu import native

    model = llm.runner.model
    projections = Counter(
        "F.linear" if p is None else p.kind for layer in model.layers
        for p in (layer.attention.qkv_packed, layer.attention.o_packed,
                  layer.mlp.gate_up_packed, layer.mlp.down_packed))
    head = model.lm_head_packed
    library = native.load()
    config = llm.loaded.config
    prefill = (native.prefill_attention_path(config.num_heads, config.num_kv_heads, config.head_dim)
               if llm.loaded.dtype == torch.bfloat16 else "torch sdpa")
    wide = (f" (float32 FMA form from {library.avx512_linear_wide_min_rows()} rows)"
            if library is not None and "avx512" in projections and native.avx512_linear_form()
            else "")
    gguf = next((p.library for p in (model.layers[0].attention.qkv_packed,)
                 if getattr(p, "kind", None) == "gguf"), None)
    if gguf is not None:
        from pagedgen.kernels.cpu import gguf as gguf_kernels

        tiles = ("bf16 tiles on AMX" if gguf.path == "amx_bf16"
                 else "bf16 tiles, float32 FMA form" if gguf_kernels.tiles_form(gguf)
                 else "bf16 tiles" if gguf.bf16_tiles else "no bf16 tiles")
        wide += f" (GGUF library {gguf.path}: {tiles})"
    return [
        "projections " + ", ".join(f"{kind} x{count}" for kind, count in projections.items())
        + wide,
        f"LM head {'F.linear' if head is None else head.kind}",
        "decode layers: one fused native call per step" if model.fused_decode is not None
        else "decode layers: layer by layer",
        f"attention: native C decode, {prefill} prefill"
        if library is not None else "attention: torch (no native library)",
    ]


def main() -> None:
    parser = runner_args(__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--weights", default=None, choices=["packed", "dequantized"],
                        help="a GGUF file's matrices: kept as stored, or dequantized at load")
    args = parser.parse_args()
    check_args(args)
    env_threads(args.threads)
    workload = load_workload(args.workload)

    import pagedgen
    from pagedgen import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, threads=args.threads, block_size=args.block_size,
              kv_memory=int(args.kv_gib * 2**30), seed=workload.seed,
              kv_cache_dtype=args.kv_cache_dtype,
              **({"weights": args.weights} if args.weights else {}))
    startup_s = seconds_since_spawn(args.spawn_time, PROCESS_START)

    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(max_tokens=g, n=workload.n, temperature=workload.temperature,
                             ignore_eos=True) for g in workload.max_tokens]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start

    failed = [r for r in results if getattr(r, "error", None)]
    if failed:
        raise RuntimeError(f"pagedgen: {len(failed)} requests failed, first: {failed[0].error}")
    outputs = [list(c.token_ids) for r in results for c in r.outputs]
    check_outputs(workload, outputs, "pagedgen")
    report = llm.memory_report()
    preemptions = report["summary"]["preemptions"]
    result = RunnerResult(
        engine="pagedgen", version=f"pagedgen {pagedgen.__version__}", threads=args.threads,
        dtype=args.dtype, num_requests=len(results), prompt_tokens=workload.prompt_tokens,
        generated_tokens=sum(map(len, outputs)), startup_s=startup_s, generate_s=generate_s,
        kv_allocated_bytes=report["pool"]["total_bytes"], kv_peak_bytes=report["summary"]["peak_bytes"],
        preemptions=preemptions, kernel_paths=kernel_paths(llm),
        notes=[f"block size {args.block_size}", f"preemptions {preemptions}",
               f"kv_cache_dtype {args.kv_cache_dtype}"]
        + ([f"weights {args.weights}"] if args.weights else []),
    )
    finish(result, outputs, args.tokens_out)


if __name__ == "__main__":
    main()
