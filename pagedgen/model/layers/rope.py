"""Rotary position embedding (HF "rotate half" layout) from a precomputed cos/sin table.

The table holds cos/sin of every position up to the model's maximum, built once; a step
gathers the rows of its token positions (one index_select shared by all layers).
Inverse frequencies follow transformers' formulas (default, linear, llama3) so that float32
results match it bit for bit where the op order allows.
"""
from __future__ import annotations

import math

import torch

from pagedgen.kernels import cpu_backend
from pagedgen.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 [head_dim // 2], scaled as config.rope_scaling says."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling or {}
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


def rope_table(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[max_positions, 2, head_dim // 2]: cos and sin of position * inv_freq.

    Computed in float32 (as transformers does) and then cast to the model dtype, which is the
    dtype transformers applies them in. Half width: both halves of the head use the same angles.
    """
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = positions[:, None] * inverse_frequencies(config)[None, :]
    return torch.stack((angles.cos(), angles.sin()), dim=1).to(dtype=dtype, device=device)


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
