"""The floor: the larger of two bounds no engine can beat on this CPU.

- compute: the workload's FLOPs at the measured rate of a large, well-shaped GEMM;
- memory: the bytes the workload must read at the measured memory bandwidth — the weights once
  per step and every live physical KV block once per step, over the fewest steps any engine
  needs (each request's tokens are sequential, so at least its max_tokens steps; prompts all
  prefilled in the first; and a step holds no more K/V than the KV budget, so a workload whose
  requests do not all fit at once needs more steps: `fewest_steps`). Shared blocks (a common
  prefix, the prompt of n samples) count once per step, so sharing cannot "beat" the floor; it
  only lowers it.
Each engine's generate time as a multiple of the larger bound says how far from the hardware
it is; which bound binds says what to optimise.
"""

from __future__ import annotations

import math
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
    sliding_layers: int = 0   # layers whose queries see only the last `window` keys
    window: int = 0

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        layers = config["num_hidden_layers"]
        return cls(hidden=config["hidden_size"], intermediate=config["intermediate_size"],
                   layers=layers, heads=heads,
                   kv_heads=config.get("num_key_value_heads", heads), head_dim=head_dim,
                   vocab=config["vocab_size"], **_sliding(config, layers))

    @property
    def full_layers(self) -> int:
        return self.layers - self.sliding_layers

    def kv_bytes_per_token(self, dtype_bytes: float, layers: int | None = None) -> float:
        count = self.layers if layers is None else layers
        return 2.0 * count * self.kv_heads * self.head_dim * dtype_bytes

    @property
    def weights_per_step(self) -> int:
        """Weights a step reads whatever its batch: the layers and the LM head (embedding rows
        are looked up, not streamed)."""
        return self.params_per_token + self.vocab * self.hidden

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


def weight_bytes(shape: ModelShape, steps: int, dtype_bytes: float = 2.0) -> float:
    """Weights read by a schedule of `steps` steps (`fewest_steps`): all of them once per step."""
    return steps * shape.weights_per_step * dtype_bytes


def fewest_steps(shape: ModelShape, workload: Workload, kv_dtype_bytes: float = 2.0,
                 budget_bytes: float | None = None) -> int:
    """Steps no engine can go below: max(max_tokens) (step 0 prefills every prompt and samples
    the first token), and the K/V that requests must hold over their sampling steps divided by
    the KV budget (every step's live K/V fits the pool). Request i holds at least its own prompt
    and each sample's s tokens at its step s in any schedule (a shared prefix is left out, and
    tokens are not rounded up to blocks, so the count stays a lower bound for any block size);
    preemption by recompute only adds steps. An engine that moved K/V out of the pool (swap,
    offload) could go below it; none of the peers here does on the CPU."""
    longest = max(workload.max_tokens)
    if budget_bytes is None:
        return longest
    held = sum(_held_bytes(shape, workload, len(p), g, kv_dtype_bytes)
               for p, g in zip(workload.prompts, workload.max_tokens))
    return max(longest, math.ceil(held / budget_bytes))


def _held_bytes(shape: ModelShape, workload: Workload, prompt: int, g: int,
                kv_dtype_bytes: float) -> float:
    """K/V bytes one request holds, summed over its steps 0..g-1 (at step s each sample has s
    tokens of its own beside the prompt); sliding layers hold at most `window` tokens of each."""
    own = prompt - workload.shared_prefix_len
    n, window = workload.n, shape.window
    full = sum(own + n * s for s in range(g))
    held = full * shape.kv_bytes_per_token(kv_dtype_bytes, shape.full_layers)
    if shape.sliding_layers:
        tokens = sum(min(own + s, window) + (n - 1) * min(s, window) for s in range(g))
        held += tokens * shape.kv_bytes_per_token(kv_dtype_bytes, shape.sliding_layers)
    return held


def kv_read_bytes(shape: ModelShape, workload: Workload, dtype_bytes: float = 2.0,
                  block_size: int = 16) -> float:
    """K/V read by the same schedule (without a budget: one only spreads these reads over more
    steps), each live physical block once per step. At step s >= 1
    request i (while s < its max_tokens) reads its prompt's blocks and each sample's blocks of
    s generated tokens; a prefix every prompt shares is read once per step while any request
    is alive. Prefill writes K/V; reading them back within the chunk is not counted. Sliding
    layers: each live request's last `window` tokens once per step (its samples may share
    them)."""
    full = _full_kv_blocks(workload, block_size) * shape.kv_bytes_per_token(
        dtype_bytes, shape.full_layers) * block_size
    if not shape.sliding_layers:
        return full
    tokens = sum(min(len(p) + s, shape.window) for s in range(1, max(workload.max_tokens))
                 for p, g in zip(workload.prompts, workload.max_tokens) if s < g)
    return full + tokens * shape.kv_bytes_per_token(dtype_bytes, shape.sliding_layers)


def _full_kv_blocks(workload: Workload, block_size: int) -> int:
    prefix = workload.shared_prefix_len
    prefix_blocks = -(-prefix // block_size)
    own_blocks = [-(-(len(p) - prefix) // block_size) for p in workload.prompts]
    total = 0
    for s in range(1, max(workload.max_tokens)):
        alive = [own for own, g in zip(own_blocks, workload.max_tokens) if s < g]
        if alive:
            total += prefix_blocks + sum(alive) + len(alive) * workload.n * -(-s // block_size)
    return total


def _token_flops(shape: ModelShape, first: int, end: int) -> float:
    """Layers and attention of the tokens at positions first..end-1 (each attends to p + 1 keys,
    at most `window` in a sliding layer)."""
    if end <= first:
        return 0.0
    per_key = 4.0 * shape.heads * shape.head_dim
    full_keys = _keys_before(end, None) - _keys_before(first, None)
    window_keys = _keys_before(end, shape.window) - _keys_before(first, shape.window)
    return (2.0 * shape.params_per_token * (end - first)
            + per_key * (shape.full_layers * full_keys + shape.sliding_layers * window_keys))


def _keys_before(n: int, window: int | None) -> float:
    """Keys read by the queries at positions 0..n-1: sum of min(p + 1, window)."""
    if window is None or n <= window:
        return n * (n + 1) / 2
    return window * (window + 1) / 2 + (n - window) * window


def _sliding(config: dict, layers: int) -> dict:
    """How many layers slide and their window, as transformers reads the config: Gemma 3's
    layer_types, else a sliding_window on every layer (Mistral) unless use_sliding_window is
    false (Qwen2 leaves it off by default)."""
    window = config.get("sliding_window") or 0
    if not window or config.get("use_sliding_window") is False:
        return {}
    types = config.get("layer_types")
    sliding = layers if types is None else sum(t == "sliding_attention" for t in types)
    return {"sliding_layers": sliding, "window": int(window)}


def measure_gemm_rate(threads: int, dtype: str = "bfloat16", size: int = 2048,
                      seconds: float = 1.0) -> float:
    """Best FLOP/s of a square GEMM with `threads` torch threads (restored after): in `dtype`,
    and for bfloat16 in float32 too, the faster of the two. bf16 products are exact in
    float32, so an engine may widen them; on CPUs whose bf16 dot-product instruction issues
    at half the float32 FMA's rate (Intel Xeons without usable AMX) the float32 GEMM is the
    faster one, and pagedgen's kernels take that form there: a floor at the bf16 rate alone
    could be beaten."""
    if dtype == "bfloat16":
        return max(_square_gemm_rate(threads, dtype, size, seconds),
                   _square_gemm_rate(threads, "float32", size, seconds))
    return _square_gemm_rate(threads, dtype, size, seconds)


def _square_gemm_rate(threads: int, dtype: str, size: int, seconds: float) -> float:
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
