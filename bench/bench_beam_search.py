"""Beam search throughput and KV sharing: pagedgen `LLM.beam_search` vs vLLM's `LLM.beam_search` and
transformers `generate(num_beams=W)`, same weights, same prompts, same dtype and threads.

    python bench/bench_beam_search.py [--prompts 32] [--widths 4 8] [--max-tokens 128]
                                      [--threads 2] [--dtype bfloat16] [--no-hf] [--no-vllm]
                                      [--vllm-venv /work/venv-vllm] [--json OUT]

The workload is --prompts random prompts of 256-512 token ids (seeded), each searched with `beam_width` W for exactly --max-tokens new tokens (no EOS: every
engine runs every step, so the work is identical). Throughput counts beam tokens: prompts x W x
max_tokens per second of wall time of the search call (prefill included). KV blocks: pagedgen's
peak blocks in use against the no-sharing counterfactual of the same run (every beam holding its
whole prefix, which is also what transformers' expanded cache holds).

pagedgen and transformers run in this process; vLLM (`BeamSearchParams(W, max_tokens,
ignore_eos=True)`, token-id prompts) runs first, in a process of its own with the Python of its
venv (bench/peers/run_vllm_beam.py; install it with bench/peers/install_vllm.py), and is skipped
where it is not installed. Its start-up (torch.compile unless --vllm-eager) is not in its figures.

The model is the benchmark model of make_bench_model.py (SmolLM2-135M shape, random weights),
built on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from make_bench_model import DEFAULT_DIR, BenchModelSpec, make_bench_model  # noqa: E402
from peers.common import Workload, save_workload  # noqa: E402
from peers.vllm_peer import add_vllm_args, run_vllm, vllm_wanted, work_dir  # noqa: E402


def make_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(256, 513, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_pagedgen(llm, prompts: list[list[int]], width: int, max_tokens: int) -> dict:
    from pagedgen import BeamSearchParams

    llm.tracker = llm.engine.tracker = llm._build_tracker(llm.runner.block_size)  # a fresh report
    copies_before = llm.engine.kv.counters.cow_copies
    params = BeamSearchParams(width, max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.sequences) == width for o in outputs)
    report = llm.memory_report()
    summary, unshared = report["summary"], report["counterfactual"]["no_sharing"]
    return {"seconds": seconds, "beam_tok_s": len(prompts) * width * max_tokens / seconds,
            "peak_blocks": summary["peak_blocks_used"], "no_sharing_blocks": unshared["peak_blocks"],
            "saved_fraction": unshared["sharing_saved_fraction"], "cow_copies": summary["cow_copies"] - copies_before,
            "preemptions": summary["preemptions"]}


def run_hf(model, prompts: list[list[int]], width: int, max_tokens: int) -> dict:
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):   # left padding
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, num_beams=width, num_return_sequences=width,
                             do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    seconds = time.perf_counter() - start
    assert out.shape[1] == longest + max_tokens
    return {"seconds": seconds, "beam_tok_s": len(prompts) * width * max_tokens / seconds}


def load_hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def run_vllm_beam(args: argparse.Namespace, prompts: list[list[int]]) -> dict | None:
    """vLLM's `LLM.beam_search` on the same prompts and widths, in its own process; None if skipped."""
    if not vllm_wanted(args):
        return None
    workload_path = work_dir(args) / "beam_workload.json"
    save_workload(Workload(prompts, [args.max_tokens] * len(prompts), "beam search"), workload_path)
    return run_vllm("run_vllm_beam.py", [
        "--model", str(args.model), "--workload", str(workload_path), "--threads", str(args.threads),
        "--dtype", args.dtype, "--widths", *map(str, args.widths)], args)


def markdown_table(results: dict) -> str:
    """The README's table: beam tok/s per engine, pagedgen's ratios, pagedgen's KV sharing."""
    lines = ["| beam width | pagedgen beam tok/s | vLLM beam tok/s | pagedgen / vLLM | transformers beam tok/s"
             " | pagedgen / transformers | KV blocks at peak | without sharing | saved |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for width, row in results["widths"].items():
        ours = row["pagedgen"]

        def peer(name: str) -> list[str]:
            if name not in row:
                return ["-", "-"]
            rate = row[name]["beam_tok_s"]
            return [f"{rate:.1f}", f"{ours['beam_tok_s'] / rate:.2f}×"]
        cells = [str(width), f"{ours['beam_tok_s']:.1f}", *peer("vllm"), *peer("transformers"),
                 f"{ours['peak_blocks']:,}", f"{ours['no_sharing_blocks']:,}", f"{ours['saved_fraction']:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--model", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--json", type=Path, help="write the results here too")
    add_vllm_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    make_bench_model(args.model)   # no-op when already built
    prompts = make_prompts(args.prompts, BenchModelSpec().vocab_size)
    load_average = [round(x, 1) for x in os.getloadavg()]   # before any engine runs
    vllm = run_vllm_beam(args, prompts)   # first: its process ends before ours loads a model
    from pagedgen import LLM

    llm = LLM(str(args.model), dtype=args.dtype, threads=args.threads, block_size=args.block_size)
    run_pagedgen(llm, prompts[:1], 2, 4)   # warm-up
    hf = None if args.no_hf else load_hf(args.model, getattr(torch, args.dtype))
    if hf is not None:
        run_hf(hf, prompts[:1], 2, 4)
    results = {"prompts": args.prompts, "prompt_tokens_median": statistics.median(map(len, prompts)),
               "max_tokens": args.max_tokens, "threads": args.threads, "dtype": args.dtype,
               "block_size": args.block_size, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "load_average_before": load_average, "vllm": vllm and {k: v for k, v in vllm.items() if k != "widths"},
               "widths": {}}
    for width in args.widths:
        row = {"pagedgen": run_pagedgen(llm, prompts, width, args.max_tokens)}
        if vllm is not None:
            row["vllm"] = vllm["widths"][str(width)]
            row["vs_vllm"] = row["pagedgen"]["beam_tok_s"] / row["vllm"]["beam_tok_s"]
        if hf is not None:
            row["transformers"] = run_hf(hf, prompts, width, args.max_tokens)
            row["speedup"] = row["pagedgen"]["beam_tok_s"] / row["transformers"]["beam_tok_s"]
        results["widths"][width] = row
        print(json.dumps({"beam_width": width, **row}, indent=1), flush=True)
    print(markdown_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
