"""Runner: llama.cpp on a GGUF file through llama-cpp-python's batch API, greedy (llama_cpp_batch.py).
Runs under llama-cpp-python's interpreter (bench_peers.py --llama-python): no torch, no pagedgen."""

from __future__ import annotations

import time

PROCESS_START = time.time()

from common import (  # noqa: E402
    RunnerResult, check_outputs, finish, load_workload, runner_args, seconds_since_spawn,
    unsupported,
)

ENGINE = "llama_cpp"


def main() -> None:
    args = runner_args(__doc__.splitlines()[0]).parse_args()
    workload = load_workload(args.workload)
    if not args.model.endswith(".gguf"):
        unsupported(ENGINE, "needs a GGUF file (bench_peers.py --weights packed)")
    if not workload.greedy or workload.n != 1:
        unsupported(ENGINE, "greedy, one sample per prompt only (this runner's batch loop)")
    if args.kv_cache_dtype != "auto":
        unsupported(ENGINE, f"kv_cache_dtype {args.kv_cache_dtype} (its KV stays f16 here)")

    import llama_cpp

    from llama_cpp_batch import N_BATCH, LlamaBatch

    batch = LlamaBatch(args.model, workload.prompts, workload.max_tokens, args.threads)
    startup_s = seconds_since_spawn(args.spawn_time, PROCESS_START)
    generate_s, outputs = batch.run(len(workload.prompts))
    check_outputs(workload, outputs, ENGINE)
    system_info = llama_cpp.llama_print_system_info().decode().strip()
    result = RunnerResult(
        engine=ENGINE, version=f"llama-cpp-python {llama_cpp.__version__}", threads=args.threads,
        dtype="as stored (GGUF)", num_requests=len(outputs), prompt_tokens=workload.prompt_tokens,
        generated_tokens=sum(map(len, outputs)), startup_s=startup_s, generate_s=generate_s,
        kernel_paths=[f"llama.cpp system info: {system_info}"],
        notes=[f"n_batch {N_BATCH}", "a KV stream per sequence", "no prefix cache"])
    finish(result, outputs, args.tokens_out)


if __name__ == "__main__":
    main()
