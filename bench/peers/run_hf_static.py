"""Runner: Hugging Face transformers `generate` in static padded batches — the contiguous baseline.

Requests go in order, up to 16 to a batch, left padded with an attention mask. Each batch runs to
its longest max_tokens (that is what static batching costs) and each output is then cut to its
own max_tokens. Generated tokens/s counts only the tokens asked for, not the padding work.
A contiguous cache cannot be paged out, so a batch is cut short where its cache (rows x (longest
prompt + longest max_tokens)) would exceed the KV budget given to every engine: what a user of
static batching does to fit memory. n > 1 is `num_return_sequences` with sampling.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

from common import (  # noqa: E402
    RunnerResult, Workload, check_args, check_outputs, env_threads, finish, kv_bytes_per_token,
    load_workload, runner_args, seconds_since_spawn, unsupported,
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


def plan_batches(workload: Workload, batch_size: int, budget: int, per_token: int) -> list[slice]:
    """Consecutive requests, up to batch_size to a batch, each batch's contiguous cache within
    `budget` bytes. Raises ValueError when one request alone does not fit."""
    batches, first = [], 0
    while first < len(workload.prompts):
        end, longest, most = first, 0, 0
        while end < len(workload.prompts) and end - first < batch_size:
            longest = max(longest, len(workload.prompts[end]))
            most = max(most, workload.max_tokens[end])
            if (end - first + 1) * workload.n * (longest + most) * per_token > budget:
                break
            end += 1
        if end == first:
            need = workload.n * (len(workload.prompts[first]) + workload.max_tokens[first]) * per_token
            raise ValueError(f"request {first} alone needs {need / 2**20:.0f} MiB of contiguous "
                             f"cache, over the {budget / 2**20:.0f} MiB KV budget")
        batches.append(slice(first, end))
        first = end
    return batches


def generate_batch(model, prompts: list[list[int]], max_tokens: list[int], workload: Workload):
    import torch

    ids, mask = left_pad(prompts)
    sampling = {"do_sample": False} if workload.greedy else {
        "do_sample": True, "temperature": workload.temperature, "top_k": 0, "top_p": 1.0}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(max_tokens),
                             num_return_sequences=workload.n, return_dict_in_generate=True,
                             **sampling)
    new_tokens = out.sequences[:, ids.shape[1]:].tolist()   # row b * n + j: sample j of prompt b
    lengths = [g for g in max_tokens for _ in range(workload.n)]
    return [row[:g] for row, g in zip(new_tokens, lengths)], cache_bytes(out.past_key_values)


def main() -> None:
    parser = runner_args(__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    check_args(args)
    if args.kv_cache_dtype != "auto":
        unsupported("hf_static", f"kv_cache_dtype {args.kv_cache_dtype} (transformers keeps K/V in the model's dtype)")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    env_threads(args.threads)
    workload = load_workload(args.workload)
    model = load_model(args.model, args.dtype, args.threads)
    per_token = kv_bytes_per_token(model.config, model.dtype.itemsize)
    try:
        batches = plan_batches(workload, args.batch_size, int(args.kv_gib * 2**30), per_token)
    except ValueError as error:
        unsupported("hf_static", str(error))
    startup_s = seconds_since_spawn(args.spawn_time, PROCESS_START)

    import torch

    torch.manual_seed(workload.seed)
    outputs, peak_kv = [], 0
    start = time.perf_counter()
    for chunk in batches:
        tokens, kv = generate_batch(model, workload.prompts[chunk], workload.max_tokens[chunk], workload)
        outputs += tokens
        peak_kv = max(peak_kv, kv)
    generate_s = time.perf_counter() - start

    check_outputs(workload, outputs, "hf_static")
    import transformers

    sizes = sorted({c.stop - c.start for c in batches})
    result = RunnerResult(
        engine="hf_static", version=f"transformers {transformers.__version__}", threads=args.threads,
        dtype=args.dtype, num_requests=len(workload.prompts), prompt_tokens=workload.prompt_tokens,
        generated_tokens=sum(map(len, outputs)), startup_s=startup_s, generate_s=generate_s,
        # Contiguous: what a batch allocates is what it holds (prompt + longest max_tokens each).
        kv_allocated_bytes=peak_kv, kv_peak_bytes=peak_kv, preemptions=0,
        notes=[f"static batches of {'/'.join(map(str, sizes))} (budget-bound where < "
               f"{args.batch_size}), left padding, sdpa; no preemption by construction"],
    )
    finish(result, outputs, args.tokens_out)


if __name__ == "__main__":
    main()
