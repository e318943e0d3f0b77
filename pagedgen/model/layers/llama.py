"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over a flat token batch.

No padding and no batch dimension: hidden states are [T, hidden] for all tokens of all
sequences of the step; which token belongs to which sequence is in StepMetadata.
"""
from __future__ import annotations

from itertools import repeat

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.model.layers.attention import PagedSelfAttention, StepMetadata
from pagedgen.model.config import ModelConfig
from pagedgen.model.layers.fused_decode import FusedDecode
from pagedgen.model.layers.norm_mlp import GatedMLP, RMSNorm, empty_parameter
from pagedgen.model.layers.linear import linear_float32, pack_weight
from pagedgen.model.layers.rope import rope_table


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = PagedSelfAttention(config)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, hidden: torch.Tensor, pending: torch.Tensor | None, step: StepMetadata,
                layer_cache: torch.Tensor, layer_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Adds `pending` (the previous layer's MLP output) to the residual stream `hidden` in
        place and returns this layer's MLP output: each residual add is fused with the norm
        that follows it. `hidden` is always a tensor the decoder's forward created."""
        normed = self.input_norm(hidden, pending)
        attended = self.attention(normed, step, layer_cache[0], layer_cache[1], layer_scales)
        return self.mlp(self.post_attention_norm(hidden, attended))


class LlamaDecoder(nn.Module):
    """Embeddings, decoder layers, final norm, LM head (sharing the embedding when tied)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_weight = empty_parameter(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head_weight = (self.embed_weight if config.tie_word_embeddings
                               else empty_parameter(config.vocab_size, config.hidden_size))
        # cos/sin of every position; filled by reset_rope_table() once the device is known.
        self.register_buffer("rope", torch.empty(0), persistent=False)
        self.lm_head_packed = None
        self.fused_decode: FusedDecode | None = None  # set by pack_weights() where it applies

    def pack_weights(self, batch_invariant: bool = False) -> None:
        """Prepack the projection weights for the device's GEMM library (CPU bf16 only).

        batch_invariant: every projection on fixed-size row tiles (model/layers/row_tiles.py)
        and no fused decode step (its kernels' shapes follow the batch)."""
        for layer in self.layers:
            layer.attention.pack_weights(row_tiled=batch_invariant)
            layer.mlp.pack_weights(row_tiled=batch_invariant)
        self.lm_head_packed = pack_weight(self.lm_head_weight, row_tiled=batch_invariant)
        self.fused_decode = None if batch_invariant else FusedDecode.build(self.config, self.layers)

    def reset_rope_table(self) -> None:
        """(Re)compute the RoPE table on the weights' device and dtype."""
        weight = self.embed_weight
        self.rope = rope_table(self.config, weight.dtype, weight.device)

    def tie_lm_head(self) -> None:
        """Make the LM head share the embedding's storage (files without an lm_head)."""
        self.lm_head_weight = self.embed_weight

    @property
    def is_tied(self) -> bool:
        return self.lm_head_weight is self.embed_weight

    def forward(self, input_ids: torch.Tensor, step: StepMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm, for every token of the batch.

        kv_cache: [L, 2, N, B, H_kv, D]; the new tokens' K/V are written into it (8-bit
        codes when step.kv_scales holds the pool's scales).
        """
        hidden = F.embedding(input_ids, self.embed_weight)
        pending = None
        # Pure decode steps on CPU: all layers in one call (it checks what it covers).
        if self.fused_decode is not None:
            pending = self.fused_decode.run(self.config, hidden, step, kv_cache)
        if pending is None:
            scales = step.kv_scales if step.kv_scales is not None else repeat(None)
            for layer, layer_cache, layer_scales in zip(self.layers, kv_cache, scales):
                pending = layer(hidden, pending, step, layer_cache, layer_scales)
        return hidden if pending is None else hidden.add_(pending)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of the given rows only (the norm is per row, so select
        first), computed in the model's dtype and rounded to it, as transformers does."""
        return linear_float32(self.norm(hidden), self.lm_head_weight, self.lm_head_packed)
