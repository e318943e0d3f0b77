"""Structured outputs: the 64-request workload with a JSON schema on every request against the
same workload unconstrained, in one process, on the default model.

    python bench/bench_structured.py                      # the full workload (64 requests)
    python bench/bench_structured.py --requests 16 --prompt-len 32 128 --max-tokens 16 64

Rounds alternate unconstrained / constrained on one loaded model (so both see the same machine
state); throughput is generated tokens per second of `generate`, median over the rounds. A
constrained request ends when its JSON is complete, so both token counts are printed; the
per-token cost is what the ratio compares. Also reported: the grammar library's one-off setup
for the tokenizer, the compile time of the schema (uncached), and the time spent filling and
applying the token masks during the constrained runs.

vLLM (bench/peers/run_vllm_structured.py: `SamplingParams(structured_outputs=
StructuredOutputsParams(json=schema))`, its default grammar backend unless --vllm-backend) runs
the same workload, the same rounds, constrained and unconstrained, after pagedgen, in a process
of its own with the Python of its venv; skipped where it is not installed
(bench/peers/install_vllm.py). With vLLM, both engines read the same files: the default GGUF
dequantized once to a bf16 safetensors folder (make_bench_model.py --from-default-gguf).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from make_bench_model import DEFAULT_GGUF_DIR, convert_default_model  # noqa: E402
from peers.common import Workload, save_workload  # noqa: E402
from peers.vllm_peer import add_vllm_args, run_vllm, vllm_wanted, work_dir  # noqa: E402
from peers.workload import FULL, random_workload  # noqa: E402

# A typical extraction schema: nested object, array, enum, numbers, required fields.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "summary": {"type": "string"},
        "topics": {"type": "array", "items": {"type": "string"}},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "source": {"type": "object",
                   "properties": {"author": {"type": "string"}, "year": {"type": "integer"}},
                   "required": ["author"]},
    },
    "required": ["title", "summary", "topics", "sentiment"],
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=FULL.num_requests)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=list(FULL.prompt_len))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=list(FULL.max_tokens))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    add_vllm_args(parser)
    parser.add_argument("--vllm-backend", default="auto", help="vLLM's structured-outputs backend")
    return parser.parse_args()


def build_workload(args: argparse.Namespace, tokenizer):
    spec = replace(FULL, num_requests=args.requests, prompt_len=tuple(args.prompt_len),
                   max_tokens=tuple(args.max_tokens))
    # bench_peers' random workload (ids above the special tokens): the default model writes
    # noise for such prompts, which the schema then has to shape, as in the setup.
    low = max(tokenizer.all_special_ids, default=-1) + 1
    return random_workload(spec, (low, len(tokenizer)))


def timed_masks(backend) -> list[float]:
    """Wraps the backend's per-step mask call; returns the list its durations go to."""
    durations, inner = [], backend.mask_logits

    def mask_logits(*args, **kwargs):
        start = time.perf_counter()
        inner(*args, **kwargs)
        durations.append(time.perf_counter() - start)
    backend.mask_logits = mask_logits
    return durations


def run_once(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return seconds, outputs


def json_outcomes(outputs) -> dict[str, int]:
    """Constrained outputs that ended by themselves (each must parse) and those cut by max_tokens."""
    ended = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    parsed = sum(1 for text in ended if isinstance(json.loads(text), dict))
    return {"complete_and_parsed": parsed, "complete": len(ended),
            "cut_by_max_tokens": len(outputs) - len(ended)}


def run_vllm_structured(args: argparse.Namespace, model: str, workload: Workload, dtype: str) -> dict | None:
    folder = work_dir(args)
    save_workload(workload, folder / "structured_workload.json")
    (folder / "schema.json").write_text(json.dumps(SCHEMA))
    return run_vllm("run_vllm_structured.py", [
        "--model", model, "--workload", str(folder / "structured_workload.json"),
        "--schema", str(folder / "schema.json"), "--rounds", str(args.rounds),
        "--threads", str(args.threads), "--dtype", dtype.removeprefix("torch."),
        "--backend", args.vllm_backend], args)


def add_vllm_result(result: dict, vllm: dict | None) -> None:
    """vLLM's figures beside ours, and pagedgen / vLLM for each kind of run."""
    if vllm is None:
        return
    result["vllm"] = vllm
    result["pagedgen_vs_vllm"] = {kind: round(rate / vllm["gen_tok_per_s"][kind], 3)
                                  for kind, rate in result["gen_tok_per_s"].items()}


def markdown_table(result: dict) -> str:
    """The README's table: gen tok/s of both engines, constrained and not, and the ratios."""
    ours, theirs = result, result["vllm"]
    lines = ["| engine | unconstrained gen tok/s | constrained gen tok/s | constrained / unconstrained"
             " | JSON parsed of complete (cut by max_tokens) | tokens (unconstrained / constrained) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in (("pagedgen", ours), (f"vLLM ({theirs['backend']})", theirs)):
        rates, tokens, outcomes = row["gen_tok_per_s"], row["generated_tokens"], row["json_outputs"]
        lines.append(f"| {name} | {rates['unconstrained']:.1f} | {rates['constrained']:.1f} | "
                     f"{row['throughput_ratio']:.2f} | {outcomes['complete_and_parsed']} of "
                     f"{outcomes['complete']} ({outcomes['cut_by_max_tokens']}) | "
                     f"{tokens['unconstrained']:,} / {tokens['constrained']:,} |")
    ratios = result["pagedgen_vs_vllm"]
    lines.append(f"| pagedgen / vLLM | {ratios['unconstrained']:.2f}× | {ratios['constrained']:.2f}× | | | |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    from pagedgen import LLM, SamplingParams, StructuredOutputsParams
    from pagedgen.engine.structured_outputs import GrammarBackend

    with_vllm = vllm_wanted(args)
    model = str(convert_default_model(DEFAULT_GGUF_DIR)) if with_vllm else None   # None: the default
    llm = LLM(model, dtype=args.dtype, threads=args.threads)
    tokenizer, engine = llm.get_tokenizer(), llm.engine
    workload = build_workload(args, tokenizer)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    spec = StructuredOutputsParams(json=SCHEMA)
    plain = [SamplingParams(max_tokens=g, temperature=0) for g in workload.max_tokens]
    constrained = [SamplingParams(max_tokens=g, temperature=0, structured_outputs=spec)
                   for g in workload.max_tokens]

    start = time.perf_counter()
    backend = GrammarBackend(tokenizer, llm.loaded.config.vocab_size, sorted(engine.eos_token_ids))
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    backend.compile(spec)
    compile_s = time.perf_counter() - start

    run_once(llm, prompts[:2], plain[:2])            # warm-up (first-call kernels, the backend)
    run_once(llm, prompts[:2], constrained[:2])
    masks = timed_masks(engine.grammar)
    rates = {"unconstrained": [], "constrained": []}
    tokens, outputs = {}, {}
    for _ in range(args.rounds):
        for name, params in (("unconstrained", plain), ("constrained", constrained)):
            seconds, outputs[name] = run_once(llm, prompts, params)
            tokens[name] = sum(len(o.outputs[0].token_ids) for o in outputs[name])
            rates[name].append(tokens[name] / seconds)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "workload": workload.description, "threads": args.threads, "dtype": str(llm.runner.dtype),
        "rounds": args.rounds, "generated_tokens": tokens,
        "gen_tok_per_s": {k: round(v, 1) for k, v in medians.items()},
        "throughput_ratio": round(medians["constrained"] / medians["unconstrained"], 3),
        "tokenizer_setup_s": round(setup_s, 3), "schema_compile_ms": round(compile_s * 1e3, 2),
        "mask_ms_per_step_median": round(statistics.median(masks) * 1e3, 3) if masks else None,
        "mask_s_total_per_round": round(sum(masks) / args.rounds, 3),
        "json_outputs": json_outcomes(outputs["constrained"]),
    }
    if with_vllm:
        add_vllm_result(result, run_vllm_structured(args, model, workload, result["dtype"]))
    print(json.dumps(result, indent=2))
    if result.get("vllm"):
        print(markdown_table(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
