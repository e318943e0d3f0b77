"""Beam search throughput and KV sharing: pagedgen `LLM.beam_search` vs transformers
`generate(num_beams=W)`, same weights, same prompts, same dtype and threads, one process.

    python bench/bench_beam_search.py [--prompts 32] [--widths 4 8] [--max-tokens 128]
                                      [--threads 2] [--dtype bfloat16] [--no-hf] [--json OUT]

The workload is --prompts random prompts of 256-512 token ids (seeded), each searched with
`beam_width` W for exactly --max-tokens new tokens (no EOS: both engines run every step, so the
work is identical). Throughput counts beam tokens: prompts x W x max_tokens per second of wall
time (prefill included). KV blocks: pagedgen's peak blocks in use against the no-sharing
counterfactual of the same run (every beam holding its whole prefix, which is also what
transformers' expanded cache holds). vLLM's `LLM.beam_search` is not run here: it needs a vLLM
install of its own (bench/peers/install_vllm.py).

The model is the benchmark model of make_bench_model.py (SmolLM2-135M shape, random weights),
built on first use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from make_bench_model import DEFAULT_DIR, BenchModelSpec, make_bench_model


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--model", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--no-hf", action="store_true", help="pagedgen only")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    make_bench_model(args.model)   # no-op when already built
    from pagedgen import LLM

    llm = LLM(str(args.model), dtype=args.dtype, threads=args.threads, block_size=args.block_size)
    prompts = make_prompts(args.prompts, BenchModelSpec().vocab_size)
    run_pagedgen(llm, prompts[:1], 2, 4)   # warm-up
    hf = None if args.no_hf else load_hf(args.model, getattr(torch, args.dtype))
    if hf is not None:
        run_hf(hf, prompts[:1], 2, 4)
    results = {"prompts": args.prompts, "prompt_tokens_median": statistics.median(map(len, prompts)),
               "max_tokens": args.max_tokens, "threads": args.threads, "dtype": args.dtype,
               "block_size": args.block_size, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "widths": {}}
    for width in args.widths:
        row = {"pagedgen": run_pagedgen(llm, prompts, width, args.max_tokens)}
        if hf is not None:
            row["transformers"] = run_hf(hf, prompts, width, args.max_tokens)
            row["speedup"] = row["pagedgen"]["beam_tok_s"] / row["transformers"]["beam_tok_s"]
        results["widths"][width] = row
        print(json.dumps({"beam_width": width, **row}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
