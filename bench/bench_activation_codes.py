"""How fine the activation quantization of the packed GGUF kernels must be to keep 98% top-1.

The int8 kernels quantize each projection's input per block of values; llama.cpp uses one int8
code per value (Q8_K: one scale per 256 values for the K-quants; Q8_0/Q8_1: per 32), pagedgen
two (the value and its remainder, docs/gguf_weights.md). One code halves the integer work per
weight, so it decides whether batch-1 decode can match llama.cpp on CPUs without AMX; this
measures what it costs in accuracy, with no kernel in the way: float32 models on the same
file's dequantized weights, every projection's input (LM head included) rounded in float32 as
the codes would round it, teacher-forced top-1 against the same model unrounded, on the held-out
windows of tests/test_gguf_real_model.py (2,555 positions of Python stdlib source).

    python bench/bench_activation_codes.py [--models default,gemma-270m] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_gguf_real_model import top1_per_position, windows  # noqa: E402  (test helpers)

from bench_gguf_perplexity import model_path  # noqa: E402  (the bench's GGUF files by name)
from pagedgen import LLM  # noqa: E402
from pagedgen.model.layers import attention, decoder, norm_mlp  # noqa: E402

# (values per scale, codes per value): llama.cpp's two block sizes, finer ones, then ours.
SCHEMES = ((256, 1), (32, 1), (16, 1), (8, 1), (256, 2), (32, 2))


def rounded(x: torch.Tensor, block: int, codes: int) -> torch.Tensor:
    """x as its codes give it back: per `block` values a step d = max|x| / 127, q1 = round(x / d);
    with two codes also q2 = round((x - d q1) / (d / 254)), the remainder at 1/254 of the step."""
    k = x.shape[-1]
    pad = (-k) % block  # a row that does not divide: its last block is short, as zeros
    blocks = torch.nn.functional.pad(x.reshape(-1, k), (0, pad)).reshape(-1, (k + pad) // block,
                                                                         block)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step == 0, torch.ones_like(step), step)
    value = torch.round(blocks / step).clamp(-127, 127) * step
    if codes == 2:
        fine = step / 254
        value = value + torch.round((blocks - value) / fine).clamp(-127, 127) * fine
    return value.reshape(-1, k + pad)[:, :k].reshape(x.shape)


class RoundedInputs:
    """Rounds the input of every projection (the functions the layers call), or none."""

    def __init__(self) -> None:
        self.originals = (attention.linear, norm_mlp.linear, decoder.linear_float32)
        self.scheme: tuple[int, int] | None = None

    def install(self) -> None:
        def wrap(fn):
            def projected(x, *args, **kwargs):
                return fn(x if self.scheme is None else rounded(x, *self.scheme), *args, **kwargs)
            return projected
        attention.linear, norm_mlp.linear, decoder.linear_float32 = map(wrap, self.originals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,gemma-270m",
                        help="'default', 'gemma-270m' or GGUF paths, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    opts = parser.parse_args()
    inputs = RoundedInputs()
    inputs.install()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; float32, dequantized weights, "
          f"threads {opts.threads}; teacher-forced top-1 against unrounded inputs")
    print("| file | " + " | ".join(f"{b} per scale, {c} code{'s' * (c > 1)}" for b, c in SCHEMES)
          + " |")
    print("| --- |" + " ---: |" * len(SCHEMES))
    for name in opts.models.split(","):
        path = str(model_path(name.strip()))
        llm = LLM(path, weights="dequantized", dtype="float32", threads=opts.threads,
                  kv_memory=64 << 20, max_num_batched_tokens=256)
        prompts = windows(llm.get_tokenizer(), 5)
        inputs.scheme = None
        reference = top1_per_position(llm, prompts)
        shares = []
        for scheme in SCHEMES:
            inputs.scheme = scheme
            got = top1_per_position(llm, prompts)
            shares.append(sum(a == b for a, b in zip(got, reference)) / len(reference))
        print(f"| {Path(path).name} ({len(reference):,} positions) | "
              + " | ".join(f"{100 * s:.1f}%" for s in shares) + " |", flush=True)
        del llm


if __name__ == "__main__":
    main()
