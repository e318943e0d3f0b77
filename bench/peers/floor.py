"""The compute floor: the workload's FLOPs over this CPU's measured bf16 GEMM rate.

No engine can beat it: it assumes every FLOP runs at the speed of a large, well-shaped GEMM and
that nothing else (memory traffic, attention kernels, Python) costs time. Each engine's generate
time as a multiple of it says how far from the hardware it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from peers.common import Workload


@dataclass(slots=True, frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(hidden=config["hidden_size"], intermediate=config["intermediate_size"],
                   layers=config["num_hidden_layers"], heads=heads,
                   kv_heads=config.get("num_key_value_heads", heads), head_dim=head_dim,
                   vocab=config["vocab_size"])

    @property
    def params_per_token(self) -> int:
        """Weights every token multiplies through: q, k, v, o and the gated MLP of every layer."""
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q_dim + 2 * kv_dim) + q_dim * self.hidden
        return self.layers * (attention + 3 * self.hidden * self.intermediate)


def workload_flops(shape: ModelShape, workload: Workload) -> float:
    """2 x params x tokens + attention, for the tokens an engine must compute.

    A request of prompt L and g new tokens runs L + g - 1 tokens through the layers (the last
    sampled token is never fed back) and needs g rows of logits. Attention at position p reads
    p + 1 keys: QK^T and PV cost 2 x 2 x (p + 1) x heads x head_dim per layer. With n samples
    the prompt is computed once and each sample its own g - 1 tokens; a prefix shared by every
    prompt is computed once for the whole workload (what prefix caching allows).
    """
    prefix = workload.shared_prefix_len
    flops = _token_flops(shape, 0, prefix)
    for prompt, g in zip(workload.prompts, workload.max_tokens):
        flops += _token_flops(shape, prefix, len(prompt))
        flops += workload.n * _token_flops(shape, len(prompt), len(prompt) + g - 1)
        flops += workload.n * 2.0 * shape.hidden * shape.vocab * g
    return flops


def _token_flops(shape: ModelShape, first: int, end: int) -> float:
    """Layers and attention of the tokens at positions first..end-1 (each attends to p + 1 keys)."""
    if end <= first:
        return 0.0
    context_sum = (end * (end + 1) - first * (first + 1)) / 2
    return (2.0 * shape.params_per_token * (end - first)
            + 4.0 * shape.layers * shape.heads * shape.head_dim * context_sum)


def measure_gemm_rate(threads: int, dtype: str = "bfloat16", size: int = 2048,
                      seconds: float = 1.0) -> float:
    """Best FLOP/s of a square GEMM in `dtype` with `threads` torch threads (restored after)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size).to(getattr(torch, dtype))
        b = torch.randn(size, size).to(getattr(torch, dtype))
        a @ b  # warm-up: first call picks kernels and touches memory
        best = float("inf")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or best == float("inf"):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return 2.0 * size**3 / best
    finally:
        torch.set_num_threads(previous)


def measure_copy_bandwidth(threads: int, megabytes: int = 256, seconds: float = 0.5) -> float:
    """Best bytes/s of a large tensor copy_ (read + write counted) with `threads` torch threads:
    the DRAM bandwidth that long-context decode attention, which streams K/V, is held against."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = torch.ones(megabytes * 2**20 // 4)
        target = torch.empty_like(source)
        target.copy_(source)  # warm-up: touches every page
        best = float("inf")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or best == float("inf"):
            start = time.perf_counter()
            target.copy_(source)
            best = min(best, time.perf_counter() - start)
        return 2.0 * source.nbytes / best
    finally:
        torch.set_num_threads(previous)
