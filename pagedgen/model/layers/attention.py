"""Self-attention over the paged KV cache, and the per-step metadata all layers share.

The kernel module is picked per device (pagedgen.kernels.get_ops: Triton on CUDA, torch on
CPU) and travels in the step metadata, so the decoder itself is device-agnostic. Anything
derived from the batch shape alone (the CPU attention plan, RoPE rows) is built once per step
here, not once per layer; so is each sliding window's plan (window_plan).

Not every step comes through here: on CPU, a pure decode step of a bfloat16 Llama-family or
Gemma 3 model whose weights are packed for our GEMMs (and not batch-invariant) runs all its
layers, this attention included, in one native call, model/layers/fused_decode.py ->
kernels/cpu/decode_step.c, with the same kernels in the same order. Decoder._fused_step
(decoder.py) is where that choice is made; prefill chunks, float32, CUDA, batch-invariant runs,
Qwen3 (its q/k norm runs in torch here) and GGUF weights kept packed always take this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

from pagedgen.model.config import ModelConfig
from pagedgen.model.layers.norm_mlp import NORMS, empty_parameter
from pagedgen.model.layers.linear import linear, pack_releasing
from pagedgen.model.layers.rope import apply_rope


@dataclass(slots=True)
class StepMetadata:
    """Everything a layer needs about the flat batch beyond its hidden states."""

    ops: ModuleType  # pagedgen.kernels.cpu_backend or triton_ops
    slot_mapping: torch.Tensor  # int64 [T]: cache slot each new token's K/V goes to
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with 0
    seq_lens: torch.Tensor  # int32 [S]: context length after this step
    query_start_loc: torch.Tensor  # int32 [S + 1]: rows of sequence s in the flat batch
    rope: torch.Tensor  # [T, 2, D/2]: cos/sin rows of the tokens' positions
    plan: Any = None  # kernel-specific precomputation (cpu_backend.AttentionPlan), or None
    kv_scales: torch.Tensor | None = None  # float32 [L or G, 2, N, H_kv] of a quantized pool
    window_plans: dict[int, Any] = field(default_factory=dict)  # sliding window -> its plan
    # A hybrid KV cache (model/runtime/kv_groups.py): each layer group's own metadata (its
    # block tables and slots), and per layer its (group, position in the KV tensor). Empty:
    # one group, layer i at position i.
    group_steps: tuple["StepMetadata", ...] = ()
    layer_slots: tuple[tuple[int, int], ...] = ()

    def for_layer(self, layer: int) -> tuple["StepMetadata", int]:
        """The metadata layer `layer` uses and its index into the KV tensor's first dimension."""
        if not self.layer_slots:
            return self, layer
        group, position = self.layer_slots[layer]
        return self.group_steps[group], position

    def window_plan(self, window: int, block_size: int) -> Any:
        """The kernels' plan for layers with this sliding window (0: full attention), built
        on first use and then shared by every layer of the step with the same window."""
        if window == 0 or self.plan is None:
            return self.plan
        if window not in self.window_plans:
            self.window_plans[window] = self.ops.plan_attention(
                self.block_tables, self.seq_lens, self.query_start_loc, block_size,
                sliding_window=window)
        return self.window_plans[window]


def build_step_metadata(ops: ModuleType, *, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, rope: torch.Tensor,
                        block_size: int, kv_scales: torch.Tensor | None = None) -> StepMetadata:
    """Metadata plus the kernels' once-per-step plan when the kernel module offers one."""
    planner = getattr(ops, "plan_attention", None)
    plan = planner(block_tables, seq_lens, query_start_loc, block_size) if planner else None
    return StepMetadata(ops=ops, slot_mapping=slot_mapping, block_tables=block_tables,
                        seq_lens=seq_lens, query_start_loc=query_start_loc, rope=rope, plan=plan,
                        kv_scales=kv_scales)


class PagedSelfAttention(nn.Module):
    """q/k/v in one GEMM, optional per-head q/k RMSNorm (Qwen3, Gemma 3), RoPE, paged attention
    (over the last `window` positions only on a sliding layer), o_proj."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attention_scale
        self.window = config.window_of(layer)
        self.eps = config.rms_norm_eps
        self.norm = NORMS[config.style.norm]
        self.qkv_weight = empty_parameter(self.q_size + 2 * self.kv_size, config.hidden_size)
        self.qkv_bias = empty_parameter(self.q_size + 2 * self.kv_size) if config.attention_bias else None
        self.o_weight = empty_parameter(config.hidden_size, self.q_size)
        self.o_bias = empty_parameter(config.hidden_size) if config.attention_output_bias else None
        # Qwen3's q_norm and k_norm weights, one row per head, so q and k are normed in one op.
        self.qk_norm_weight = (empty_parameter(self.num_heads + self.num_kv_heads, self.head_dim)
                               if config.qk_norm else None)
        self.qkv_packed = self.o_packed = None  # set by pack_weights()

    def pack_weights(self, row_tiled: bool = False) -> None:
        self.qkv_packed = pack_releasing(self, "qkv_weight", self.qkv_packed, row_tiled)
        self.o_packed = pack_releasing(self, "o_weight", self.o_packed, row_tiled)

    def forward(self, hidden: torch.Tensor, step: StepMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scales: torch.Tensor | None = None,
                cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        """scales: this layer's [2, N, H_kv] when the pool is quantized, else None.
        cos_sin: the RoPE rows [T, 2, D/2] of this layer's RoPE (default: step.rope)."""
        tokens = hidden.shape[0]
        qkv = linear(hidden, self.qkv_weight, self.qkv_bias, self.qkv_packed)
        # q and k are adjacent columns of qkv: normalise and rotate them together.
        qk = qkv[:, :self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads,
                                                      self.head_dim)
        if self.qk_norm_weight is not None:
            qk = self.norm(qk, self.qk_norm_weight, self.eps)
        qk = apply_rope(qk, step.rope if cos_sin is None else cos_sin)
        query, key = qk[:, :self.num_heads], qk[:, self.num_heads:]
        value = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        # Only a quantized pool passes scales: the unquantized calls stay exactly as they were.
        quantized = {} if scales is None else {"k_scales": scales[0], "v_scales": scales[1]}
        step.ops.store_kv(key, value, k_cache, v_cache, step.slot_mapping, **quantized)
        attended = self._paged_attention(query, step, k_cache, v_cache, quantized)
        return linear(attended.reshape(tokens, self.q_size), self.o_weight, self.o_bias,
                      self.o_packed)

    def _paged_attention(self, query, step: StepMetadata, k_cache, v_cache,
                         quantized: dict) -> torch.Tensor:
        args = (query, k_cache, v_cache, step.block_tables, step.seq_lens, step.query_start_loc,
                self.scale)
        # Full-attention layers call the kernels exactly as before windows existed.
        window = {"sliding_window": self.window} if self.window else {}
        plan = step.window_plan(self.window, k_cache.shape[1])
        if plan is None:
            return step.ops.paged_attention(*args, **quantized, **window)
        return step.ops.paged_attention(*args, plan=plan, **quantized, **window)
