"""Whole KV blocks as bytes and back, for the prefix store on disk.

A block's bytes: its K and V for every layer, [L, 2, B, H_kv, D] in the pool's element type,
then, beside an 8-bit pool, its scales [L, 2, H_kv] float32. One index_select per direction
for all the step's blocks, never a per-block or per-token loop over the pool.
"""

from __future__ import annotations

import numpy as np
import torch


def block_payload_size(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> int:
    size = _per_block_elements(kv_cache) * kv_cache.element_size()
    if kv_scales is not None:
        size += _per_block_elements(kv_scales) * kv_scales.element_size()
    return size


@torch.inference_mode()
def read_blocks(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                block_ids: list[int]) -> np.ndarray:
    """uint8 [len(block_ids), payload size] on the CPU: a copy, safe to hand to another thread."""
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    parts = [_blocks_as_bytes(kv_cache, ids)]
    if kv_scales is not None:
        parts.append(_blocks_as_bytes(kv_scales, ids))
    rows = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return rows.to("cpu").numpy()


@torch.inference_mode()
def write_blocks(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_ids: list[int],
                 payloads: list[memoryview]) -> None:
    """Copies stored blocks into the pool (and their scales)."""
    rows = torch.from_numpy(np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads]))
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    kv_size = _per_block_elements(kv_cache) * kv_cache.element_size()
    _bytes_into_blocks(kv_cache, ids, rows[:, :kv_size])
    if kv_scales is not None:
        _bytes_into_blocks(kv_scales, ids, rows[:, kv_size:])


def _per_block_elements(pool: torch.Tensor) -> int:
    """Elements of one block: everything but the block axis (axis 2 of both pools)."""
    return pool.numel() // pool.shape[2]


def _blocks_as_bytes(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    picked = pool.index_select(2, ids)                     # [L, 2, n, ...]
    dims = list(range(picked.dim()))
    per_block = picked.permute(2, *dims[:2], *dims[3:]).contiguous()
    return per_block.view(torch.uint8).reshape(len(ids), -1)


def _bytes_into_blocks(pool: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    shape = (len(ids), pool.shape[0], pool.shape[1], *pool.shape[3:])
    values = rows.contiguous().view(pool.dtype).reshape(shape).to(pool.device)
    dims = list(range(values.dim()))
    pool.index_copy_(2, ids, values.permute(1, 2, 0, *dims[3:]))
