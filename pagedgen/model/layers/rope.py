"""Rotary position embedding (HF "rotate half" layout) from a precomputed cos/sin table.

The table holds cos/sin of every position up to the model's maximum, built once; a step
gathers the rows of its token positions (one index_select shared by all layers). A model whose
layers use different RoPEs (Gemma 3: base 10k on sliding layers, 1M on global ones) keeps one
table per distinct RoPE side by side in each row, so that one gather still serves every layer.
Inverse frequencies follow transformers' formulas (default, linear, llama3) so that float32
results match it bit for bit where the op order allows.
"""
from __future__ import annotations

import math

import torch

from pagedgen.kernels.cpu import backend as cpu_backend
from pagedgen.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig, layer: int = 0) -> torch.Tensor:
    """float32 [head_dim // 2] of the RoPE `layer` applies, scaled as its scaling says."""
    theta, scaling = config.rope_of(layer)
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (theta ** exponents)
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling, config.max_position_embeddings)
    if rope_type == "freq_factors":  # llama.cpp's rope_freqs tensor: per-frequency divisors
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict, max_positions: int) -> torch.Tensor:
    """Llama 3.1: low frequencies divided by `factor`, high kept, a smooth blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling.get("original_max_position_embeddings", max_positions)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_indices(config: ModelConfig) -> list[int]:
    """Per layer, which of the model's distinct RoPEs it applies (0 where all layers share one)."""
    distinct: list = []
    indices = []
    for layer in range(config.num_layers):
        rope = repr(config.rope_of(layer))  # theta and scaling dict, compared by value
        if rope not in distinct:
            distinct.append(rope)
        indices.append(distinct.index(rope))
    return indices


def rope_table(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[max_positions, 2 * R, head_dim // 2]: cos and sin of position * inv_freq for each of the
    model's R distinct RoPEs (rows 2r and 2r + 1: RoPE r's cos and sin; R is 1 but for Gemma).

    Computed in float32 (as transformers does) and then cast to the model dtype, which is the
    dtype transformers applies them in. Half width: both halves of the head use the same angles.
    """
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    indices = rope_indices(config)
    first_layers = [indices.index(r) for r in range(max(indices) + 1)]
    parts = []
    for layer in first_layers:
        angles = positions[:, None] * inverse_frequencies(config, layer)[None, :]
        parts += [angles.cos(), angles.sin()]
    return torch.stack(parts, dim=1).to(dtype=dtype, device=device)


def split_rope_rows(rows: torch.Tensor) -> list[torch.Tensor]:
    """A step's gathered table rows [T, 2 * R, D/2] -> R contiguous [T, 2, D/2] (R = 1: as is)."""
    if rows.shape[1] == 2:
        return [rows]
    return [rows[:, 2 * r:2 * r + 2].contiguous() for r in range(rows.shape[1] // 2)]


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by cos_sin [T, 2, D/2] (the table rows of the tokens' positions).

    Same arithmetic as transformers' `x * cos + rotate_half(x) * sin`, written per half.
    """
    fused = cpu_backend.rope(x, cos_sin)  # one pass on CPU in bfloat16 (bit-identical), else None
    if fused is not None:
        return fused
    half = x.shape[-1] // 2
    cos = cos_sin[:, None, 0]  # [T, 1, D/2], broadcast over heads
    sin = cos_sin[:, None, 1]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
