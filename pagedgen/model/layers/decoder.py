"""The decoder of every supported family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM, Gemma 3)
over a flat token batch.

No padding and no batch dimension: hidden states are [T, hidden] for all tokens of all
sequences of the step; which token belongs to which sequence is in StepMetadata.
What differs between families is data (ModelConfig.style, layer_types, rope_of): the norm
style, Gemma's sandwich norms and scaled embeddings, each layer's window and RoPE.
On CPU in bfloat16, with the weights packed for our GEMMs or GGUF blocks kept as stored, a
pure decode step runs every layer in one native call (fused_decode.py): the Llama family (not
Qwen3) and Gemma 3, on a one-group or a hybrid KV pool.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.model.config import ModelConfig
from pagedgen.model.layers.attention import PagedSelfAttention, StepMetadata
from pagedgen.model.layers.fused_decode import FusedDecode
from pagedgen.model.layers.linear import linear_float32, pack_releasing, pack_weight
from pagedgen.model.layers.norm_mlp import GatedMLP, RMSNorm, empty_parameter
from pagedgen.model.layers.quantized_linear import embedding_rows
from pagedgen.model.layers.rope import rope_indices, rope_table, split_rope_rows
from pagedgen.settings import default


class DecoderLayer(nn.Module):
    """Attention then MLP, each on a normed residual stream. Names follow Llama: `input_norm`
    before attention, `post_attention_norm` before the MLP; with sandwich norms (Gemma) also
    `attention_out_norm` and `mlp_out_norm` on the two outputs before they join the stream."""

    def __init__(self, config: ModelConfig, layer: int = 0, rope_index: int = 0) -> None:
        super().__init__()
        size, eps, style = config.hidden_size, config.rms_norm_eps, config.style
        self.rope_index = rope_index
        self.input_norm = RMSNorm(size, eps, style.norm)
        self.attention = PagedSelfAttention(config, layer)
        self.post_attention_norm = RMSNorm(size, eps, style.norm)
        self.mlp = GatedMLP(size, config.intermediate_size, config.hidden_act)
        sandwich = style.sandwich_norms
        self.attention_out_norm = RMSNorm(size, eps, style.norm) if sandwich else None
        self.mlp_out_norm = RMSNorm(size, eps, style.norm) if sandwich else None

    def forward(self, hidden: torch.Tensor, pending: torch.Tensor | None, step: StepMetadata,
                layer_cache: torch.Tensor, layer_scales: torch.Tensor | None = None,
                cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        """Adds `pending` (the previous layer's MLP output) to the residual stream `hidden` in
        place and returns this layer's MLP output: each residual add is fused with the norm
        that follows it. `hidden` is always a tensor the decoder's forward created."""
        normed = self.input_norm(hidden, pending)
        attended = self.attention(normed, step, layer_cache[0], layer_cache[1], layer_scales,
                                  cos_sin)
        if self.attention_out_norm is not None:
            attended = self.attention_out_norm(attended)
        out = self.mlp(self.post_attention_norm(hidden, attended))
        return out if self.mlp_out_norm is None else self.mlp_out_norm(out)


class Decoder(nn.Module):
    """Embeddings, decoder layers, final norm, LM head (sharing the embedding when tied)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_weight = empty_parameter(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, layer, rope_index)
                                    for layer, rope_index in enumerate(rope_indices(config)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.style.norm)
        self.lm_head_weight = (self.embed_weight if config.tie_word_embeddings
                               else empty_parameter(config.vocab_size, config.hidden_size))
        # cos/sin of every position; filled by reset_rope_table() once the device is known.
        self.register_buffer("rope", torch.empty(0), persistent=False)
        self.lm_head_packed = None
        self.fused_decode: FusedDecode | None = None  # set by pack_weights() where it applies
        # GGUF matrices kept packed (model/loading/gguf_packed.py), else None
        self.gguf_packed = self.embed_packed = None

    def pack_weights(self, batch_invariant: bool = default("batch_invariant")) -> None:
        """Prepack the projection weights for the device's GEMM library (CPU).

        batch_invariant: every projection on fixed-size row tiles (model/layers/row_tiles.py)
        and no fused decode step (its kernels' shapes follow the batch)."""
        if self.gguf_packed is not None:
            self.gguf_packed.install(self, batch_invariant)
        else:
            for layer in self.layers:
                layer.attention.pack_weights(row_tiled=batch_invariant)
                layer.mlp.pack_weights(row_tiled=batch_invariant)
            self.lm_head_packed = self.pack_lm_head(batch_invariant)
        windows = [layer.attention.window for layer in self.layers]
        self.fused_decode = None if batch_invariant else FusedDecode.build(
            self.config, self.layers, windows if any(windows) else None)

    def pack_lm_head(self, row_tiled: bool) -> object | None:
        """The LM head's dense packing; a tied head keeps the table the look-ups read."""
        if self.is_tied:
            return pack_weight(self.lm_head_weight, row_tiled=row_tiled)
        return pack_releasing(self, "lm_head_weight", self.lm_head_packed, row_tiled)

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

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Packed GGUF weights: the rows are looked up from the quantized table.
        hidden = (F.embedding(input_ids, self.embed_weight) if self.embed_packed is None
                  else embedding_rows(input_ids, self.embed_packed, self.embed_weight.dtype))
        if self.config.style.scaled_embedding:
            # As transformers: sqrt(hidden) as a float32 scalar, rounded to the weight dtype.
            scale = torch.tensor(self.config.hidden_size ** 0.5).to(self.embed_weight.dtype)
            hidden = hidden.mul_(scale)
        return hidden

    def forward(self, input_ids: torch.Tensor, step: StepMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm, for every token of the batch.

        kv_cache: [L, 2, N, B, H_kv, D], or [G, 2, N, B, H_kv, D] for a hybrid cache (see
        StepMetadata.for_layer); the new tokens' K/V are written into it (8-bit
        codes when step.kv_scales holds the pool's scales).
        """
        hidden = self.embed(input_ids)
        pending = self._fused_step(hidden, step, kv_cache)
        if pending is None:
            pending = self._layer_by_layer(hidden, step, kv_cache)
        return hidden if pending is None else hidden.add_(pending)

    def _fused_step(self, hidden: torch.Tensor, step: StepMetadata,
                    kv_cache: torch.Tensor) -> torch.Tensor | None:
        """The step's path is chosen here, and only here. The fused path runs every layer in one
        native call (fused_decode.py -> kernels/cpu/decode_step.c, the same kernels in the same
        order, so the result is bit-identical) when it covers the step: CPU, bfloat16 weights
        packed for our GEMMs, a pure decode step (no prefill chunk), at most the GEMM kernel's
        rows, the Llama family (not Qwen3: its q/k norm) or Gemma 3, one-group or hybrid KV
        pools, not batch-invariant (pack_weights builds no fused_decode then).
        Otherwise None: the layers run one by one (_layer_by_layer, attention.py)."""
        if self.fused_decode is None:
            return None
        return self.fused_decode.run(self.config, hidden, step, kv_cache)  # None: not covered

    def _layer_by_layer(self, hidden: torch.Tensor, step: StepMetadata,
                        kv_cache: torch.Tensor) -> torch.Tensor | None:
        pending = None
        ropes = split_rope_rows(step.rope)  # one [T, 2, D/2] per distinct RoPE
        scales = step.kv_scales
        for index, layer in enumerate(self.layers):
            # A hybrid cache: the layer's group metadata and its position in kv_cache.
            layer_step, position = step.for_layer(index)
            layer_scales = None if scales is None else scales[position]
            pending = layer(hidden, pending, layer_step, kv_cache[position], layer_scales,
                            ropes[layer.rope_index])
        return pending

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of the given rows only (the norm is per row, so select
        first), computed in the model's dtype and rounded to it, as transformers does."""
        return linear_float32(self.norm(hidden), self.lm_head_weight, self.lm_head_packed)
