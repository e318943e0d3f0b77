"""Runner: Hugging Face transformers `generate` in static padded batches — the contiguous baseline.

Requests go in order, 16 to a batch, left padded with an attention mask. Each batch runs to its
longest max_tokens (that is what static batching costs) and each output is then cut to its own
max_tokens. Generated tokens/s counts only the tokens asked for, not the padding work.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

from common import (  # noqa: E402
    RunnerResult, check_args, check_outputs, env_threads, finish, load_workload, runner_args,
    seconds_since_spawn,
)

PAD_ID = 0  # any id works: padded positions are masked out and never attended to


def load_model(path: str, dtype: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    # ignore_eos: no EOS at all (DESIGN.md: min_new_tokens would mask the EOS logit and change argmax).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model.eval()


def left_pad(prompts: list[list[int]]):
    """[B, L] input ids and attention mask, padded on the left to the longest prompt."""
    import torch

    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    return ids, mask


def cache_bytes(past_key_values) -> int:
    """Bytes held by a DynamicCache at the end of generate (its peak: it only grows)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in past_key_values.layers)


def generate_batch(model, prompts: list[list[int]], max_tokens: list[int]):
    import torch

    ids, mask = left_pad(prompts)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(max_tokens),
                             do_sample=False, return_dict_in_generate=True)
    new_tokens = out.sequences[:, ids.shape[1]:].tolist()
    return [row[:g] for row, g in zip(new_tokens, max_tokens)], cache_bytes(out.past_key_values)


def main() -> None:
    parser = runner_args(__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    check_args(args)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    env_threads(args.threads)
    workload = load_workload(args.workload)
    model = load_model(args.model, args.dtype, args.threads)
    startup_s = seconds_since_spawn(args.spawn_time, PROCESS_START)

    outputs, peak_kv = [], 0
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), args.batch_size):
        chunk = slice(first, first + args.batch_size)
        tokens, kv = generate_batch(model, workload.prompts[chunk], workload.max_tokens[chunk])
        outputs += tokens
        peak_kv = max(peak_kv, kv)
    generate_s = time.perf_counter() - start

    check_outputs(workload, outputs, "hf_static")
    import transformers

    result = RunnerResult(
        engine="hf_static", version=f"transformers {transformers.__version__}", threads=args.threads,
        dtype=args.dtype, num_requests=len(outputs), prompt_tokens=workload.prompt_tokens,
        generated_tokens=sum(map(len, outputs)), startup_s=startup_s, generate_s=generate_s,
        # Contiguous: what a batch allocates is what it holds (prompt + longest max_tokens each).
        kv_allocated_bytes=peak_kv, kv_peak_bytes=peak_kv,
        notes=[f"static batches of {args.batch_size}, left padding, sdpa"],
    )
    finish(result, outputs, args.tokens_out)


if __name__ == "__main__":
    main()
