"""Quantized KV cache: capacity, quality and decode speed of each kv_cache_dtype against auto (bf16).

    python bench/bench_kv_quant.py [--capacity] [--quality] [--speed] [--long] [--threads 1]
                                   [--json F]

--capacity (exact arithmetic, no model load): at one KV budget (default 1 GiB, pagedgen's CPU
  default), bytes per token, blocks, and
  the largest number of concurrent sequences of the w64 workload (bench_peers' 64 requests,
  prompt 32..512, max_tokens 16..256, seed 0) the pool holds at their full length, taken in
  workload order (cycled).
--quality (default model, bf16 weights): greedy agreement with the bf16 KV cache over the first
  --new-tokens generated tokens of --prompts English prompts (the share of tokens before each
  prompt's first mismatch; the share of prompts identical throughout), and the mean absolute
  difference of the chosen tokens' logprobs over positions where both runs still agree;
  perplexity of a fixed English text (the history section of Python's LICENSE.txt, first
  --ppl-tokens tokens), written into the pool in chunks of 256 tokens and scored from the
  logits of every position, each chunk attending to the quantized blocks before it.
--speed: a decode step of --batch sequences at context --context through ModelRunner.execute
  (median of --repeats), the pool filled with random values (the format's codes for 8-bit).
--long: the `long` workload reduced to --long-requests requests (random token ids of the bench
  model, `make_bench_model.py`; prompts 6,000..7,500, 64 new tokens, greedy, ignore_eos, seed 0)
  through LLM.generate per kv_cache_dtype: generated tok/s (generated tokens / the generate
  call's wall time; its CPU seconds beside) and its ratio to auto; --long-gather adds each 8-bit format with its native
  prefill attention switched off (gather + dequantize + SDPA), the path before it existed.
Nothing is printed with a date: copy the figures with the date and machine into the README.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench_model_step import decode_batch, median_timing
from pagedgen.kernels.kv_quant import KV_CACHE_DTYPES, kv_format, quantize
from pagedgen.cli.inspect_memory import KVShape, pool_sizing

SMOLLM2_KV = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # the default model's KV shape


# --- capacity -------------------------------------------------------------------------------

def w64_lengths() -> list[int]:
    """prompt + max_tokens of the w64 workload's requests (bench/peers/workload.py FULL, seed 0)."""
    from peers.workload import FULL, random_workload

    workload = random_workload(FULL, (3, 8192))
    return [len(p) + g for p, g in zip(workload.prompts, workload.max_tokens)]


def concurrent_sequences(num_blocks: int, block_size: int, lengths: list[int]) -> int:
    """How many sequences, taken in order (cycling), fit at their full length at once."""
    used = 0
    for count, length in enumerate(itertools.cycle(lengths)):
        used += -(-length // block_size)
        if used > num_blocks:
            return count


def capacity(budget: int, block_size: int) -> list[dict]:
    lengths = w64_lengths()
    rows = []
    for name in KV_CACHE_DTYPES:
        sizing = pool_sizing(KVShape(**SMOLLM2_KV, dtype="bfloat16", kv_cache_dtype=name),
                             block_size, 8192, kv_memory_bytes=budget)
        rows.append({"kv_cache_dtype": name, "bytes_per_token": sizing.bytes_per_token,
                     "num_blocks": sizing.num_blocks,
                     "w64_sequences": concurrent_sequences(sizing.num_blocks, block_size, lengths)})
    base = rows[0]["w64_sequences"]
    for row in rows:
        row["vs_auto"] = row["w64_sequences"] / base
    return rows


# --- quality --------------------------------------------------------------------------------

def english_text() -> str:
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    return path.read_text()


def english_prompts(tokenizer, count: int, length: int = 24) -> list[list[int]]:
    """`count` prompts of `length` tokens: consecutive slices of the English text."""
    ids = tokenizer(english_text())["input_ids"]
    step = max(length, (len(ids) - length) // count)
    return [ids[i * step:i * step + length] for i in range(count)]


def generate(llm, prompts, new_tokens: int):
    from pagedgen import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob if len(lp) == 1 else
                                      lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                       o.outputs[0].logprobs)])
            for o in outputs]


def agreement(base, other) -> dict:
    before_mismatch, total, identical, diffs = 0, 0, 0, []
    for (ids_a, lp_a), (ids_b, lp_b) in zip(base, other):
        same = next((i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), len(ids_a))
        before_mismatch += same
        total += len(ids_a)
        identical += same == len(ids_a)
        diffs += [abs(a - b) for a, b in zip(lp_a[:same], lp_b[:same])]
    return {"tokens_before_first_mismatch": before_mismatch / total,
            "identical_prompts": identical / len(base),
            "logprob_mean_abs_diff": sum(diffs) / max(len(diffs), 1)}


def perplexity(runner, token_ids: list[int], chunk: int = 256) -> float:
    """exp(mean NLL) of token_ids[1:], computed chunk by chunk through the paged pool."""
    nll, top1 = score_tokens(runner, token_ids, chunk)
    return math.exp(nll / len(top1))


@torch.inference_mode()
def score_tokens(runner, token_ids: list[int], chunk: int = 256) -> tuple[float, list[int]]:
    """The summed NLL of token_ids[1:] and the model's top-1 token at each of those positions
    (teacher-forced), chunk by chunk through the paged pool from position 0."""
    from pagedgen.model.runtime.batch import ScheduledChunk, build_flat_batch

    block_size = runner.block_size
    blocks = -(-len(token_ids) // block_size)
    table = list(range(blocks))
    groups = len(runner.group_windows)  # a hybrid pool: each layer group its own pages
    nll, top1 = 0.0, []
    for start in range(0, len(token_ids) - 1, chunk):
        end = min(start + chunk, len(token_ids) - 1)
        used = -(-end // block_size)
        group_tables = None if groups == 1 else [
            [g * blocks + b for b in table[:used]] for g in range(groups)]
        piece = ScheduledChunk(token_ids[start:end], start, table[:used], True,
                               group_tables=group_tables)
        flat = build_flat_batch([piece], block_size)
        hidden = runner.model(flat.input_ids, runner._step_metadata(flat), runner.kv_cache)
        logprobs = torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1)
        targets = torch.tensor(token_ids[start + 1:end + 1])
        nll -= float(logprobs.gather(1, targets[:, None]).sum())
        top1 += logprobs.argmax(dim=-1).tolist()
    return nll, top1


def quality(args) -> dict:
    from pagedgen import LLM

    results, base = {}, None
    for name in KV_CACHE_DTYPES:
        llm = LLM(dtype="bfloat16", kv_cache_dtype=name, threads=args.threads, seed=0)
        prompts = english_prompts(llm.get_tokenizer(), args.prompts)
        outputs = generate(llm, prompts, args.new_tokens)
        text_ids = llm.get_tokenizer()(english_text())["input_ids"][:args.ppl_tokens]
        row = {"perplexity": perplexity(llm.runner, text_ids)}
        if base is None:
            base = (outputs, row["perplexity"])
        else:
            row |= agreement(base[0], outputs)
            row["perplexity_vs_auto"] = row["perplexity"] / base[1] - 1
        results[name] = row
        print(name, json.dumps(row), flush=True)
        del llm
    return results


# --- speed ----------------------------------------------------------------------------------

def fill_random(runner) -> None:
    """Random K/V (and for 8-bit pools, the codes and scales of random values)."""
    fmt = kv_format(runner.kv_cache_dtype)
    if fmt is None:
        runner.kv_cache.normal_()
        return
    values = torch.randn(runner.kv_cache.shape)
    scales = values.abs().amax(dim=(3, 5)) / fmt.qmax  # [L, 2, N, H]
    runner.kv_cache.copy_(quantize(values, scales[:, :, :, None, :, None], fmt))
    runner.kv_scales.copy_(scales)


def speed(args) -> dict:
    from pagedgen.model.loading.loader import load_model
    from pagedgen.model.runtime.runner import ModelRunner
    from pagedgen.settings import EngineConfig

    loaded = load_model(None, dtype="bfloat16", device="cpu")
    per_seq = -(-(args.context + 1) // 16)
    decode = decode_batch(args.batch, args.context, 16)
    results = {}
    for name in KV_CACHE_DTYPES:
        runner = ModelRunner(loaded, EngineConfig(block_size=16, num_blocks=args.batch * per_seq,
                                                  kv_cache_dtype=name))
        fill_random(runner)
        timing = median_timing(lambda: runner.execute(decode, []), args.repeats)
        results[name] = {"decode_step_ms": timing.wall_s * 1e3, "cpu_ms": timing.cpu_s * 1e3,
                         "tokens_per_s": args.batch / timing.wall_s}
        print(name, json.dumps(results[name]), flush=True)
        del runner
    return results


# --- long prompts ---------------------------------------------------------------------------

def long_workload(args):
    from transformers import AutoTokenizer

    from make_bench_model import make_bench_model
    from peers.workload import SUITE, random_workload

    model = make_bench_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    token_range = (max(tokenizer.all_special_ids, default=-1) + 1, min(len(tokenizer), vocab))
    spec = replace(SUITE["long"][0], num_requests=args.long_requests)
    return model, random_workload(spec, token_range)


def long_prompts(args) -> dict:
    from pagedgen import LLM, SamplingParams
    from pagedgen.kernels.cpu import native

    model, workload = long_workload(args)
    print(f"long: {workload.description}", flush=True)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in workload.max_tokens]
    runs = [(name, True) for name in KV_CACHE_DTYPES]
    if args.long_gather:
        runs += [(name, False) for name in KV_CACHE_DTYPES if name != "auto"]
    dispatch, results = native.prefill_attention_q8, {}
    for name, native_prefill in runs:
        native.prefill_attention_q8 = dispatch if native_prefill else (lambda *a: False)
        try:
            llm = LLM(str(model), dtype="bfloat16", kv_cache_dtype=name, threads=args.threads,
                      seed=0)
            start, cpu_start = time.perf_counter(), time.process_time()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        finally:
            native.prefill_attention_q8 = dispatch
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        label = name if native_prefill else f"{name} (gather prefill)"
        # CPU seconds too: on a shared machine wall time also counts other processes' load
        results[label] = {"wall_s": wall, "cpu_s": cpu, "generated_tokens": generated,
                          "generated_tok_per_s": generated / wall}
        results[label]["vs_auto"] = (results[label]["generated_tok_per_s"]
                                     / results["auto"]["generated_tok_per_s"])
        print(label, json.dumps(results[label]), flush=True)
        del llm
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", action="store_true")
    parser.add_argument("--quality", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--long", action="store_true")
    parser.add_argument("--long-requests", type=int, default=2)
    parser.add_argument("--long-gather", action="store_true",
                        help="--long also with the 8-bit formats' native prefill switched off")
    parser.add_argument("--budget-mib", type=int, default=1024, help="KV budget for --capacity")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not (args.capacity or args.quality or args.speed or args.long):
        args.capacity = True
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, weights bfloat16, block_size {args.block_size}")
    out = {"threads": args.threads}
    if args.capacity:
        out["capacity"] = capacity(args.budget_mib * 2**20, args.block_size)
        for row in out["capacity"]:
            print(f"{row['kv_cache_dtype']:<9} {row['bytes_per_token']:>6,} B/token "
                  f"{row['num_blocks']:>7,} blocks  w64 sequences {row['w64_sequences']:>5} "
                  f"({row['vs_auto']:.2f}x auto)")
    if args.quality:
        out["quality"] = quality(args)
    if args.speed:
        out["speed"] = speed(args)
    if args.long:
        out["long"] = long_prompts(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
