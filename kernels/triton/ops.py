"""Triton paged-KV kernels (the CUDA path), same signatures as cpu_backend.

Also runs on CPU tensors under TRITON_INTERPRET=1 (set before this module is imported),
which is how the tests check it on machines without a GPU.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton

from ..checks import (check_attention_args, check_copy_args, check_lengths, check_metadata,
                      check_plan_fits, check_plan_window, check_store_args, check_window)
from ..kv_quant import store_kv_quantized
from .attention_kernel import paged_attention_kernel
from .cache_kernels import copy_blocks_kernel, store_kv_kernel

__all__ = ["TritonAttentionPlan", "copy_blocks", "paged_attention", "plan_attention", "store_kv"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_STORE_TOKENS = 16  # tokens per store_kv program
_COPY_CHUNK = 4096  # elements per copy_blocks program
_TARGET_ROWS = 64  # query rows (tokens x heads of a group) per attention tile on prefill
_MIN_DOT = 16  # tl.dot needs every dimension >= 16 on the GPU


@dataclass(slots=True)
class TritonAttentionPlan:
    """What the launch needs from the metadata; built once per step (one host sync)."""

    block_size: int
    num_tokens: int
    max_q_len: int
    sliding_window: int = 0


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int,
                   sliding_window: int = 0) -> TritonAttentionPlan:
    check_metadata(block_tables, seq_lens, query_start_loc, block_size)
    check_window(sliding_window)
    starts = query_start_loc.long().cpu()
    q_lens = starts[1:] - starts[:-1]
    check_lengths(block_tables, seq_lens.long().cpu(), q_lens, block_size)
    max_q_len = int(q_lens.max()) if q_lens.numel() else 0
    return TritonAttentionPlan(block_size, int(starts[-1]), max_q_len, sliding_window)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
             k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
    """Write K/V of token t into slot slot_mapping[t]; slot -1 skips the token.

    A quantized pool (k_scales/v_scales given) is written by kv_quant's torch code on any
    device: each touched block is re-quantized as a whole, a gather/scatter, not a per-slot store.
    """
    check_store_args(key, value, k_cache, v_cache, slot_mapping)
    if k_scales is not None:
        store_kv_quantized(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)
        return
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row = num_heads * head_dim
    store_kv_kernel[(triton.cdiv(num_tokens, _STORE_TOKENS),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        *key.stride(), *value.stride(),
        HEAD_DIM=head_dim, ROW=row, ROW_PAD=triton.next_power_of_2(row), TOKENS=_STORE_TOKENS)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every layer's K and V of block src[i] into block dst[i] (copy-on-write)."""
    check_copy_args(kv_cache, src, dst)
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if src.numel() == 0:
        return
    num_layers, _, _, *block_shape = kv_cache.shape
    block_elems = math.prod(block_shape)
    chunk = min(_COPY_CHUNK, triton.next_power_of_2(block_elems))
    grid = (src.numel(), num_layers * 2, triton.cdiv(block_elems, chunk))
    copy_blocks_kernel[grid](kv_cache, src, dst, kv_cache.stride(1), kv_cache.stride(2),
                             CHUNK=chunk)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *,
                    plan: TritonAttentionPlan | None = None,
                    k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None,
                    sliding_window: int = 0) -> torch.Tensor:
    """Causal paged attention over a flat batch (docs/contracts.md §2), reading K/V
    through the block tables. `plan` (plan_attention of the same metadata and window) saves
    a sync. sliding_window W > 0: a query at p sees keys in (p - W, p]."""
    check_attention_args(query, k_cache, v_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    block_size = k_cache.shape[1]
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, block_size,
                              sliding_window)
    check_plan_fits(plan.block_size, plan.num_tokens, query, k_cache)
    check_plan_window(plan.sliding_window, sliding_window)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if plan.max_q_len == 0:
        return out
    _launch_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                      scale, plan.max_q_len, out, k_scales, v_scales, sliding_window)
    return out


def _launch_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                      scale, max_q_len, out, k_scales=None, v_scales=None,
                      sliding_window=0) -> None:
    quantized = k_scales is not None
    if quantized and (k_scales.stride() != v_scales.stride() or k_scales.stride(1) != 1):
        raise ValueError("k_scales and v_scales must be [N, H_kv] rows with the same strides")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = _query_tile(max_q_len, group_pad)
    grid = (block_tables.shape[0], num_kv_heads, triton.cdiv(max_q_len, block_q))
    paged_attention_kernel[grid](
        query, k_cache, v_cache, out,
        k_scales if quantized else out, v_scales if quantized else out,  # unread when not
        block_tables, seq_lens, query_start_loc,
        scale * math.log2(math.e), sliding_window,
        *query.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        k_scales.stride(0) if quantized else 0,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE_N=max(block_size, 64),
        COMPUTE_FP32=_INTERPRETED,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        QUANTIZED=quantized)


def _query_tile(max_q_len: int, group_pad: int) -> int:
    """Query tokens per tile: enough rows for tl.dot (>= 16), ~64 rows on prefill."""
    rows = _TARGET_ROWS if max_q_len > 1 else _MIN_DOT
    return max(1, rows // group_pad)
