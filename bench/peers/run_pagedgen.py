"""Runner: pagedgen through its Python API (`from pagedgen import LLM, SamplingParams`)."""

from __future__ import annotations

import time

PROCESS_START = time.time()

from common import (  # noqa: E402
    RunnerResult, check_args, check_outputs, env_threads, finish, load_workload, runner_args,
    seconds_since_spawn,
)


def main() -> None:
    parser = runner_args(__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    check_args(args)
    env_threads(args.threads)
    workload = load_workload(args.workload)

    import pagedgen
    from pagedgen import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, threads=args.threads, block_size=args.block_size,
              kv_memory=int(args.kv_gib * 2**30))
    startup_s = seconds_since_spawn(args.spawn_time, PROCESS_START)

    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(max_tokens=g, temperature=0, ignore_eos=True) for g in workload.max_tokens]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start

    failed = [r.request_id for r in results if getattr(r, "error", None)]
    if failed:
        raise RuntimeError(f"pagedgen: requests {failed} failed: {results[0].error}")
    outputs = [list(r.outputs[0].token_ids) for r in results]
    check_outputs(workload, outputs, "pagedgen")
    report = llm.memory_report()
    result = RunnerResult(
        engine="pagedgen", version=f"pagedgen {pagedgen.__version__}", threads=args.threads,
        dtype=args.dtype, num_requests=len(outputs), prompt_tokens=workload.prompt_tokens,
        generated_tokens=sum(map(len, outputs)), startup_s=startup_s, generate_s=generate_s,
        kv_allocated_bytes=report["pool"]["total_bytes"], kv_peak_bytes=report["summary"]["peak_bytes"],
        notes=[f"block size {args.block_size}", f"preemptions {report['summary']['preemptions']}"],
    )
    finish(result, outputs, args.tokens_out)


if __name__ == "__main__":
    main()
