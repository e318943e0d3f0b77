"""Deliberately simple paged-KV kernels: the test oracle.

Every function here favours obviousness over speed: one sequence at a time, explicit gathers
through the block table, an explicit float32 softmax. The fast paths (cpu_backend, triton_ops)
are checked against these; these are checked once against dense causal attention.
"""
from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's K/V into slot slot_mapping[t] (block = slot // B, offset = slot % B)."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:  # -1: token is not stored (e.g. a prefix-cache hit recomputed for logits)
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = key[t]
        v_cache[block, offset] = value[t]


def _gather_sequence(cache: torch.Tensor, table: torch.Tensor, first: int,
                     length: int) -> torch.Tensor:
    """Tokens first..length-1 of one sequence as [length - first, H_kv, D], via its block table.

    Only the listed positions are read: blocks before `first` may be freed or reused."""
    block_size = cache.shape[1]
    positions = torch.arange(first, length)
    blocks = table.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first: int,
                window: int) -> torch.Tensor:
    """Causal attention of q [q_len, H_q, D] at the last q_len positions of a context whose
    keys first.. are k/v [ctx - first, H_kv, D]; with window W > 0 a query at p sees (p - W, p]."""
    q_len, num_q_heads, _ = q.shape
    num_keys, num_kv_heads, _ = k.shape
    ctx_len = first + num_keys
    group = num_q_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # GQA: query head h reads kv head h // group
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    query_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
    key_pos = torch.arange(first, ctx_len)[None, :]
    hidden = key_pos > query_pos
    if window > 0:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Causal paged attention over a flat batch of sequences (contract: docs/contracts.md §2).

    sliding_window W > 0: a query at position p sees keys in (p - W, p]; 0: all keys <= p."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        first = first_key(seq_len - (end - begin), sliding_window)
        k = _gather_sequence(k_cache, block_tables[s], first, seq_len)
        v = _gather_sequence(v_cache, block_tables[s], first, seq_len)
        out[begin:end] = _attend_one(query[begin:end], k, v, scale, first,
                                     sliding_window).to(query.dtype)
    return out


def first_key(first_query: int, window: int) -> int:
    """The earliest key position any query at first_query or later can see."""
    return max(0, first_query - window + 1) if window > 0 else 0


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every layer's K and V of block src[i] into block dst[i]."""
    for s, d in zip(src.tolist(), dst.tolist()):
        kv_cache[:, :, d] = kv_cache[:, :, s]
