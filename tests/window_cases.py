"""Sliding-window attention inputs for the kernel tests: batches that cross the window in
every way, an independent dense oracle, and NaN poison in the blocks a window has dropped."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_batch import PagedBatch, make_paged_batch


def window_batch_lens(block_size: int, window: int) -> tuple[list[int], list[int]]:
    """(seq_lens, q_lens): decodes shorter than, at and past the window; fresh prefills and
    chunks after cached context, shorter and longer than the window."""
    b, w = block_size, window
    seq_lens = [1, w, w + 1, 3 * w + b + 7, 2 * w + 3, 3 * w + 5, 4 * b + w + 3, max(w - 1, 1)]
    q_lens = [1, 1, 1, 1, 2 * w + 3, w + 5, 3, max(w - 1, 1)]
    return seq_lens, q_lens


def windowed_batch(block_size: int, window: int, *, num_q_heads: int, num_kv_heads: int,
                   head_dim: int, dtype=torch.float32, seed: int = 0) -> PagedBatch:
    seq_lens, q_lens = window_batch_lens(block_size, window)
    return make_paged_batch(seq_lens, q_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)


def dropped_blocks(batch: PagedBatch, window: int) -> list[int]:
    """Physical blocks that lie wholly before the window of every query of their sequence."""
    block_size = batch.k_cache.shape[1]
    q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    dropped = []
    for s, (seq_len, q_len) in enumerate(zip(batch.seq_lens.tolist(), q_lens)):
        first_key = max(0, seq_len - q_len - window + 1)
        dropped += batch.block_tables[s, :first_key // block_size].tolist()
    return dropped


def poison_dropped_blocks(batch: PagedBatch, window: int, *caches: torch.Tensor) -> int:
    """Fill the dropped blocks of `caches` (default: the batch's K and V) with NaN, as a
    block given back to the pool may hold anything; returns how many blocks were poisoned."""
    blocks = torch.tensor(dropped_blocks(batch, window), dtype=torch.long)
    for cache in caches or (batch.k_cache, batch.v_cache):
        cache[blocks] = float("nan")
    return blocks.numel()


def dense_windowed_attention(q, k, v, scale: float, window: int) -> torch.Tensor:
    """q [L, H_q, D], k/v [L, H_kv, D] of one contiguous sequence, a boolean band mask."""
    length, num_kv_heads = k.shape[0], k.shape[1]
    pos = torch.arange(length)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    group = q.shape[1] // num_kv_heads
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=band, scale=scale)
    return out.transpose(0, 1)
