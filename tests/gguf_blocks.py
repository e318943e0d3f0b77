"""Random GGUF blocks for kernel tests, and deliberately broken copies of them.

Blocks come from gguf.quants.quantize of random floats where the package can quantize the
type, else from random bytes with sane fp16 scales (the K-quants: every bit pattern of
their codes and 6-bit scales is a valid block). The broken copies model the classic
unpacking bugs; the reference of a broken copy is what a kernel with that bug would compute.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import quantize

QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# Byte offsets of each type's fp16 fields inside a block: scale d, then (where there is one) the
# min m or dmin.
HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
# Where the 4 low bits of the codes live (byte offset, length) in a block.
NIBBLES = {T.Q4_0: (2, 16), T.Q4_1: (4, 16), T.Q5_0: (6, 16), T.Q5_1: (8, 16),
           T.Q4_K: (16, 128), T.Q5_K: (48, 128)}


def random_blocks(kind: T, rows: int, k: int, rng: np.random.Generator,
                  from_bytes: bool = False) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid blocks of `kind`."""
    if kind in QUANTIZABLE and not from_bytes:
        # rows of different magnitudes, and a few outliers, as trained weights have
        weights = rng.standard_normal((rows, k)) * rng.uniform(0.01, 0.1, (rows, 1))
        weights[rng.random((rows, k)) < 0.01] *= 8
        return quantize(weights.astype(np.float32), kind)
    values, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, k // values, size), dtype=np.uint8)
    scale = rng.uniform(1e-4, 2e-3, (rows, k // values))
    # dmin near half the code range times d, so values centre on zero as trained weights do
    centring = {T.Q4_K: 8.0, T.Q5_K: 16.0}.get(kind, 1.0)
    for offset, factor in zip(HALF_FIELDS[kind], (1.0, centring)):
        halves = (scale * factor).astype(np.float16)
        blocks[:, :, offset:offset + 2] = halves.view(np.uint8).reshape(rows, k // values, 2)
    return blocks.reshape(rows, -1)


def _per_block(blocks: np.ndarray, kind: T) -> np.ndarray:
    values, size = GGML_QUANT_SIZES[kind]
    return blocks.reshape(blocks.shape[0], -1, size).copy()


def swap_nibble_halves(blocks: np.ndarray, kind: T) -> np.ndarray:
    """The low and high 4 bits of every code byte exchanged."""
    view = _per_block(blocks, kind)
    start, length = NIBBLES[kind]
    codes = view[:, :, start:start + length]
    view[:, :, start:start + length] = (codes >> 4) | (codes << 4)
    return view.reshape(blocks.shape)


def neighbour_scale(blocks: np.ndarray, kind: T) -> np.ndarray:
    """Each block reads the next block's scale d (the last one wraps to the row's first)."""
    view = _per_block(blocks, kind)
    offset = HALF_FIELDS[kind][0]
    view[:, :, offset:offset + 2] = np.roll(view[:, :, offset:offset + 2], -1, axis=1)
    return view.reshape(blocks.shape)


def drop_min(blocks: np.ndarray, kind: T) -> np.ndarray:
    """The min term (m of Q4_1/Q5_1, dmin of Q4_K/Q5_K) forgotten: set to zero."""
    view = _per_block(blocks, kind)
    offset = HALF_FIELDS[kind][1]
    view[:, :, offset:offset + 2] = 0
    return view.reshape(blocks.shape)


def unpack_scales_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    q = packed.astype(np.int32)
    low = [(q[..., j] & 63, q[..., j + 4] & 63) for j in range(4)]
    high = [((q[..., j + 4] & 0xF) | ((q[..., j - 4] >> 6) << 4),
             (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)) for j in range(4, 8)]
    pairs = low + high
    return np.stack([p[0] for p in pairs], -1), np.stack([p[1] for p in pairs], -1)


def pack_scales_k4(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """The inverse of unpack_scales_k4."""
    out = np.zeros(scales.shape[:-1] + (12,), dtype=np.int32)
    for j in range(4):
        out[..., j] = (scales[..., j] & 63) | ((scales[..., j + 4] >> 4) << 6)
        out[..., j + 4] = (mins[..., j] & 63) | ((mins[..., j + 4] >> 4) << 6)
        out[..., j + 8] = (scales[..., j + 4] & 0xF) | ((mins[..., j + 4] & 0xF) << 4)
    return out.astype(np.uint8)


def scales_off_by_one(blocks: np.ndarray, kind: T) -> np.ndarray:
    """Q4_K/Q5_K: sub-block s uses the 6-bit scale and min of sub-block s + 1 (mod 8)."""
    view = _per_block(blocks, kind)
    scales, mins = unpack_scales_k4(view[:, :, 4:16])
    view[:, :, 4:16] = pack_scales_k4(np.roll(scales, -1, -1), np.roll(mins, -1, -1))
    return view.reshape(blocks.shape)
