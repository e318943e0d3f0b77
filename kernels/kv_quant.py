"""Quantized KV pools: the formats, and the torch code that writes and reads them.

A quantized pool stores K/V as 8-bit codes ([L, 2, N, B, H_kv, D] in int8 or a float8 dtype)
and, beside it, one float32 scale per block, K/V and KV head ([L, 2, N, H_kv]):
value = code * scale. Per block and head because a block is the unit the pool already
shares, copies and caches: a scale travels with its block (copy-on-write, prefix hits), an
outlier head or token spoils only its own block, and the overhead is 4 bytes per B x D codes.

Blocks are written token by token during decode, so a block's scale is its running absolute
maximum over qmax: when a new token's |value| exceeds what the scale reaches, the block's
codes are re-quantized to the larger scale (exact when the scale does not change). A write at
a block's offset 0 starts it afresh (a newly allocated block: the old scale and codes belong
to a previous owner). Error bound per element (docs/kv_quantization.md): int8, written in one
go, |x - x^| <= s/2; each re-quantization adds at most s/2 (s = the final scale). The fp8
formats round to nearest: relative error 2^-4 (e4m3) or 2^-3 (e5m2), plus the subnormal
floor, and the same extra half step per re-quantization.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cpu import native

__all__ = ["KV_CACHE_DTYPES", "KVFormat", "copy_block_scales", "dequantize", "error_bound",
           "format_of", "gather_dequantized", "kv_format", "quantize", "store_kv_quantized"]


@dataclass(frozen=True, slots=True)
class KVFormat:
    name: str  # the kv_cache_dtype value users give
    storage: torch.dtype  # dtype of the codes in the pool
    qmax: float  # largest code magnitude: the block's absmax maps to it
    relative_error: float  # round-to-nearest relative error of one quantization (0: absolute)
    subnormal_step: float  # code spacing near zero, in units of the scale


_FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0, 0.0, 1.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, 2.0 ** -4, 2.0 ** -9),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, 2.0 ** -3, 2.0 ** -16),
}
KV_CACHE_DTYPES = ("auto", *_FORMATS)
SCALE_DTYPE = torch.float32
_TINY = 1e-30  # scale floor: an all-zero block keeps finite codes (0 / tiny = 0)


def kv_format(name: str | None) -> KVFormat | None:
    """The format for a kv_cache_dtype value; None for "auto" (the model's dtype, unscaled)."""
    if name in (None, "auto"):
        return None
    if name not in _FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return _FORMATS[name]


def format_of(dtype: torch.dtype) -> KVFormat | None:
    """The format whose codes have this dtype, or None (an unquantized pool)."""
    return next((f for f in _FORMATS.values() if f.storage == dtype), None)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Codes of float32 `x` for a broadcastable `scale`; clamped, so fp8 never becomes NaN."""
    scaled = (x / scale).clamp_(-fmt.qmax, fmt.qmax)
    if fmt.storage == torch.int8:
        scaled = scaled.round_()
    return scaled.to(fmt.storage)


def dequantize(codes: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.to(torch.float32) * scale).to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view: index_copy_ has no float8 kernel on CPU, a byte copy is the same move."""
    return t.view(torch.uint8)


def store_kv_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
    """Write tokens into a quantized pool (caches [N, B, H, D] codes, scales [N, H]).

    Each touched block is dequantized, gets its new tokens, and is re-quantized with
    max(old scale, new tokens' absmax / qmax) per head: one vectorized pass over the
    touched blocks, whatever the number of tokens.
    """
    fmt = format_of(k_cache.dtype)
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() == 0:
        return
    capacity = k_cache.shape[0] * block_size
    if int(slots.max()) >= capacity:  # checked first: write all or nothing
        raise ValueError(f"slot_mapping has a slot past the cache's {capacity} slots")
    blocks, offsets = slots // block_size, slots % block_size
    touched, which = torch.unique(blocks, return_inverse=True)
    # A decode step (one token per block) on CPU: the C store does the same per block.
    if (touched.numel() == slots.numel() and slots.numel() == slot_mapping.numel()
            and native.store_kv_q8(key, value, k_cache, v_cache, k_scales, v_scales,
                                   slot_mapping)):
        return
    # A write at offset 0 opens a block: whatever it held before belongs to a previous owner.
    fresh = torch.zeros(touched.numel(), dtype=torch.bool, device=slots.device)
    fresh[which[offsets == 0]] = True
    for x, cache, scales in ((key, k_cache, k_scales), (value, v_cache, v_scales)):
        _write_blocks(x, cache, scales, fmt, touched, which, offsets, fresh)


def _write_blocks(x, cache, scales, fmt: KVFormat, touched, which, offsets, fresh) -> None:
    x = x.to(torch.float32)
    old_scale = scales.index_select(0, touched).masked_fill_(fresh[:, None], 0.0)  # [U, H]
    token_max = x.abs().amax(-1)  # [T, H]
    absmax = torch.zeros_like(old_scale).scatter_reduce_(
        0, which[:, None].expand_as(token_max), token_max, "amax")
    new_scale = torch.maximum(old_scale, absmax / fmt.qmax).clamp_min_(_TINY)
    block_vals = dequantize(cache.index_select(0, touched), old_scale[:, None, :, None])
    block_vals[which, offsets] = x
    codes = quantize(block_vals, new_scale[:, None, :, None], fmt)
    _bytes(cache).index_copy_(0, touched, _bytes(codes))
    scales.index_copy_(0, touched, new_scale)


def error_bound(fmt: KVFormat, x: torch.Tensor, scale: torch.Tensor,
                requantizations: int = 0) -> torch.Tensor:
    """The documented round-trip bound on |x - dequantize(quantize(x))| per element, for a
    block whose final scale is `scale` and whose codes were re-quantized that many times."""
    half_step = torch.maximum(fmt.relative_error * x.abs() * (1 + fmt.relative_error),
                              0.5 * fmt.subnormal_step * scale)
    return (1 + requantizations) * half_step


def gather_dequantized(cache: torch.Tensor, scales: torch.Tensor, blocks: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Blocks `blocks` of a quantized cache as `dtype` values [len(blocks), B, H, D]."""
    codes = _bytes(cache).index_select(0, blocks).view(cache.dtype)
    return dequantize(codes, scales.index_select(0, blocks)[:, None, :, None], dtype)


def copy_block_scales(kv_scales: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy-on-write of scales [L, 2, N, H]: block dst[i] gets block src[i]'s scales."""
    if src.numel():
        kv_scales.index_copy_(2, dst.long(), kv_scales.index_select(2, src.long()))
