"""Batch-invariant paged attention: each query row's bits depend only on its own keys.

The fast path splits the step by kind (the decode kernel for one-token sequences, a flash
kernel or SDPA for prefill chunks), so the same token can come out with other last bits in a
decode step than in a prefill chunk, and with other chunk boundaries. Here EVERY query row,
prefill or decode, is attended as a decode of its own: keys 0..its position, read through its
sequence's block table. The native decode kernel (cpu_decode_attention*.c) computes each such
row in one thread, keys in order, with no split that depends on the other rows; so a row's
bits depend on its query and keys alone, not on the step, the chunking or the thread count's
split of the work.

Where the native kernel does not apply, a torch path gives the same guarantee (not the same
bits as the native kernel):
- scores and P@V are batched GEMMs whose every item has one fixed shape per model
  ([group, head_dim] @ [head_dim, block] and [group, block] @ [block, head_dim]): measured on
  CPU (MKL, float32), a batched item's result does not depend on the batch count or its
  position, whereas a plain matmul's rows change with the number of rows;
- the softmax max is taken over the row's visible keys (max is exact in any order);
- sums over keys and blocks are cumsums (a sequential float64 scan on CPU), so blocks past
  the row's last key, which add exact zeros, leave the result unchanged.
Its queries are processed in row tiles only to bound memory; tiling never changes a row's bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import native
from ..checks import check_window
from .attention_plan import first_visible_block, windowed_tables

TILE_ELEMENTS = 1 << 22  # gathered K (float32) per row tile: bounds memory, not results

__all__ = ["InvariantOps", "paged_attention"]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *, sliding_window: int = 0,
                    **_unused) -> torch.Tensor:
    """Causal paged attention over a flat batch (docs/contracts.md §2), batch-invariant.

    sliding_window W > 0: the row at position p sees keys (p - W, p]; each row's table then
    starts at the block of its first visible key (a function of p alone, so still invariant)."""
    check_window(sliding_window)
    tokens = query.shape[0]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(q_lens.numel(), device=query.device), q_lens)
    offsets = torch.arange(tokens, device=query.device) - starts[:-1][seq_of_row]
    visible = (seq_lens.long() - q_lens)[seq_of_row] + offsets + 1  # keys 0..position
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    tables = block_tables.long().index_select(0, seq_of_row)
    if tokens and sliding_window:
        first_block = first_visible_block(visible - 1, sliding_window, block_size)
        tables, visible = windowed_tables(tables, visible, first_block, block_size)
    if native.decode_attention(query, k_cache, v_cache, tables, visible, scale, out,
                               sliding_window, share_blocks=False):
        return out
    blocks_needed = (visible + block_size - 1) // block_size
    per_row = int(blocks_needed.max()) * block_size * num_kv_heads * head_dim if tokens else 1
    tile = max(1, TILE_ELEMENTS // per_row)
    for begin in range(0, tokens, tile):
        rows = slice(begin, min(begin + tile, tokens))
        width = int(blocks_needed[rows].max())
        out[rows] = _attend_rows(query[rows], k_cache, v_cache, tables[rows, :width],
                                 visible[rows], scale, sliding_window)
    return out


def _attend_rows(query, k_cache, v_cache, tables, visible, scale, window) -> torch.Tensor:
    """query [R, H_q, D]; tables int64 [R, nb]; visible int64 [R]: the row sees keys
    0..visible-1 of its table (the last `window` of them where window > 0)."""
    rows, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads = tables.shape[1], k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    key_index = torch.arange(num_blocks * block_size, device=query.device)
    seen = key_index[None, :] < visible[:, None]
    if window > 0:
        seen &= key_index[None, :] >= visible[:, None] - window
    seen = seen.view(rows, num_blocks, block_size)
    # [R, H_kv, nb, D, B] and [R, H_kv, nb, B, D]: one GEMM item per (row, kv head, block)
    keys = k_cache[tables].float().permute(0, 3, 1, 4, 2)
    values = v_cache[tables].float().masked_fill_(~seen[..., None, None], 0.0)  # no stale NaN
    values = values.permute(0, 3, 1, 2, 4)
    q = (query.float() * scale).view(rows, num_kv_heads, 1, group, head_dim)
    q = q.expand(rows, num_kv_heads, num_blocks, group, head_dim)
    scores = torch.matmul(q, keys)  # [R, H_kv, nb, G, B]
    scores.masked_fill_(~seen[:, None, :, None, :], float("-inf"))
    row_max = scores.amax(dim=(2, 4), keepdim=True)  # the row's own key is visible: finite
    probs = (scores - row_max).exp_()  # exactly 0 where masked
    flat_probs = probs.permute(0, 1, 3, 2, 4).reshape(rows, num_kv_heads, group, -1)
    total = flat_probs.cumsum(-1)[..., -1:]  # [R, H_kv, G, 1]
    partial = torch.matmul(probs, values)  # [R, H_kv, nb, G, D]
    weighted = partial.cumsum(2)[:, :, -1]  # [R, H_kv, G, D]
    return (weighted / total).view(rows, num_q_heads, head_dim).to(query.dtype)


@dataclass(frozen=True, slots=True)
class InvariantOps:
    """A kernel module (docs/contracts.md §2) whose attention is batch-invariant; the cache
    writes and block copies (plain copies, exact anyway) are the base module's."""

    base: object

    def store_kv(self, *args, **kwargs) -> None:
        self.base.store_kv(*args, **kwargs)

    def copy_blocks(self, *args, **kwargs) -> None:
        self.base.copy_blocks(*args, **kwargs)

    @staticmethod
    def paged_attention(*args, **kwargs) -> torch.Tensor:
        return paged_attention(*args, **kwargs)
