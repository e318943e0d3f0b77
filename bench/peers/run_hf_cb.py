"""Runner: transformers' continuous batching (paged attention) with per-request max_new_tokens.

`generate_batch` takes one max_new_tokens for all requests, so this goes through the manager:
`init_continuous_batching` -> `add_request(..., max_new_tokens=g)` -> `get_result()` until every
request is finished. Start-up includes building the manager and its paged cache (the KV budget
given to every engine) and its warm-up.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

from common import (  # noqa: E402
    RunnerResult, Workload, check_args, check_outputs, env_threads, finish, kv_bytes_per_token,
    load_workload, runner_args, seconds_since_spawn, unsupported,
)

NO_EOS = -1  # transformers CB's own "EOS disabled" value: ignore_eos


def start_manager(args, workload: Workload):
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attn)
    cb_config = ContinuousBatchingConfig(auto_switch_to_flash=False)
    per_block = kv_bytes_per_token(model.config, dtype.itemsize) * cb_config.page_size
    cb_config.num_blocks = max(1, int(args.kv_gib * 2**30) // per_block)
    sampling = {"do_sample": False} if workload.greedy else {
        "do_sample": True, "temperature": workload.temperature, "top_k": 0, "top_p": 1.0}
    # n > 1: the manager forks each request into n - 1 children ("<id>__child#<i>").
    gen_config = GenerationConfig(eos_token_id=NO_EOS, pad_token_id=0,
                                  max_new_tokens=max(workload.max_tokens),
                                  num_return_sequences=workload.n, **sampling)
    hints = WorkloadHints(max_prompt_length=max(map(len, workload.prompts)),
                          max_generated_length=max(workload.max_tokens), num_requests=len(workload.prompts))
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=cb_config, workload_hints=hints)
    manager.warmup()
    manager.start()
    return manager


def sample_id(request_id: str, sample: int) -> str:
    """The manager's id for sample `sample` of a request (sample 0 is the request itself)."""
    return request_id if sample == 0 else f"{request_id}__child#{sample - 1}"


def collect(manager, count: int, timeout_s: float) -> dict[str, list[int]]:
    """Wait for `count` finished requests; a failed request or a dead loop raises."""
    results: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"hf_cb: {len(results)}/{count} requests finished in {timeout_s} s")
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("hf_cb: the generation loop stopped before all requests finished")
            continue
        if out.is_finished():
            if out.error:
                raise RuntimeError(f"hf_cb: request {out.request_id} failed: {out.error}")
            results[out.request_id] = list(out.generated_tokens)
    return results


def main() -> None:
    parser = runner_args(__doc__.splitlines()[0])
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "paged|eager"])
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    args = parser.parse_args()
    check_args(args)
    if args.kv_cache_dtype != "auto":
        unsupported("hf_cb", f"kv_cache_dtype {args.kv_cache_dtype} (transformers keeps K/V in the model's dtype)")
    env_threads(args.threads)
    workload = load_workload(args.workload)
    import torch

    torch.manual_seed(workload.seed)
    manager = start_manager(args, workload)
    startup_s = seconds_since_spawn(args.spawn_time, PROCESS_START)

    start = time.perf_counter()
    for i, (prompt, g) in enumerate(zip(workload.prompts, workload.max_tokens)):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=g, eos_token_id=NO_EOS)
    results = collect(manager, len(workload.prompts) * workload.n, args.timeout)
    generate_s = time.perf_counter() - start

    kv_bytes = manager.batch_processor.cache.cache_tensor.nbytes
    manager.stop(block=True, timeout=30)
    outputs = [results[sample_id(f"r{i}", j)] for i in range(len(workload.prompts))
               for j in range(workload.n)]
    check_outputs(workload, outputs, "hf_cb")
    import transformers

    result = RunnerResult(
        engine="hf_cb", version=f"transformers {transformers.__version__}", threads=args.threads,
        dtype=args.dtype, num_requests=len(workload.prompts), prompt_tokens=workload.prompt_tokens,
        generated_tokens=sum(map(len, outputs)), startup_s=startup_s, generate_s=generate_s,
        kv_allocated_bytes=kv_bytes,
        notes=[f"continuous batching, attn {args.attn}"],
    )
    finish(result, outputs, args.tokens_out)


if __name__ == "__main__":
    main()
