"""Triton kernels that move K/V: store this step's tokens, copy blocks for copy-on-write.

Both work on tiles (many tokens / a whole block row per program) rather than one element
per program: fewer, wider operations suit the GPU and keep the CPU interpreter fast.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_kd,  # key strides (value shares them)
    stride_vt, stride_vh, stride_vd,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # H_kv * head_dim: one slot's elements, contiguous in the cache
    ROW_PAD: tl.constexpr,  # next power of two of ROW
    TOKENS: tl.constexpr,  # tokens per program
):
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    token_ok = tokens < num_tokens
    slots = tl.load(slot_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)
    keep = token_ok & (slots >= 0)  # slot -1: this token is not stored
    elems = tl.arange(0, ROW_PAD)
    heads, dims = elems // HEAD_DIM, elems % HEAD_DIM
    mask = keep[:, None] & (elems < ROW)[None, :]
    t64 = tokens.to(tl.int64)[:, None]
    key = tl.load(key_ptr + t64 * stride_kt + heads[None, :] * stride_kh
                  + dims[None, :] * stride_kd, mask=mask)
    value = tl.load(value_ptr + t64 * stride_vt + heads[None, :] * stride_vh
                    + dims[None, :] * stride_vd, mask=mask)
    dest = slots[:, None] * ROW + elems[None, :]
    tl.store(k_cache_ptr + dest, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def copy_blocks_kernel(
    cache_ptr, src_ptr, dst_ptr,
    stride_layer_kv,  # elements between consecutive (layer, K/V) planes
    stride_block,  # elements between consecutive blocks (= B * H * D)
    CHUNK: tl.constexpr,  # elements copied per program
):
    copy_id, plane, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src = tl.load(src_ptr + copy_id).to(tl.int64)  # int64 before multiplying by strides
    dst = tl.load(dst_ptr + copy_id).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < stride_block
    base = cache_ptr + plane.to(tl.int64) * stride_layer_kv
    row = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, row, mask=mask)
