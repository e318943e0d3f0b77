"""Whole KV blocks as bytes and back, for the prefix store on disk.

A page's bytes: its K and V for every layer of its group, [G, 2, B, H_kv, D] in the pool's
element type, then, beside an 8-bit pool, its scales [G, 2, H_kv] float32. A stored block is
every layer's K/V of its tokens: its page in each layer group, so its bytes are the K/V of
those pages in group order, then their scales in group order (one group: exactly one page,
the classic [L, 2, B, H_kv, D] + [L, 2, H_kv]). One index_select per direction for all the
step's pages, never a per-block or per-token loop over the pool.

Pages are given per stored block: a page id (one group) or a tuple of its page id in each
group. A negative id (the manager's NULL_BLOCK) is a page a sliding group does not load (before
its window): that part of the payload is skipped when copying in; reading out never meets one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

BlockPages = Sequence[int] | Sequence[Sequence[int]]


def block_payload_size(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                       num_groups: int = 1) -> int:
    return num_groups * (_page_kv_bytes(kv_cache) + _page_scale_bytes(kv_scales))


@torch.inference_mode()
def read_blocks(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                block_pages: BlockPages) -> np.ndarray:
    """uint8 [len(block_pages), payload size] on the CPU: a copy, safe to hand to another
    thread."""
    ids = _page_ids(block_pages)
    count = ids.shape[0]
    flat = ids.reshape(-1).to(kv_cache.device)
    parts = [_blocks_as_bytes(kv_cache, flat).reshape(count, -1)]
    if kv_scales is not None:
        parts.append(_blocks_as_bytes(kv_scales, flat).reshape(count, -1))
    rows = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return rows.to("cpu").numpy()


@torch.inference_mode()
def write_blocks(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                 block_pages: BlockPages, payloads: list[memoryview]) -> None:
    """Copies stored blocks into the pool (and their scales), skipping the pages not loaded."""
    ids = _page_ids(block_pages)
    count, groups = ids.shape
    rows = torch.from_numpy(np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads]))
    kv_size = _page_kv_bytes(kv_cache)
    flat = ids.reshape(-1)
    loaded = flat >= 0
    every = bool(loaded.all())
    pages = (flat if every else flat[loaded]).to(kv_cache.device)

    def page_rows(part: torch.Tensor) -> torch.Tensor:
        per_page = part.reshape(count * groups, -1)  # the payload's pages, in group order
        return per_page if every else per_page[loaded]

    _bytes_into_blocks(kv_cache, pages, page_rows(rows[:, :groups * kv_size]))
    if kv_scales is not None:
        _bytes_into_blocks(kv_scales, pages, page_rows(rows[:, groups * kv_size:]))


def _page_ids(block_pages: BlockPages) -> torch.Tensor:
    """int64 [blocks, groups] (one column for plain page ids)."""
    ids = torch.tensor(block_pages, dtype=torch.int64)
    return ids.reshape(len(block_pages), -1)


def _page_kv_bytes(pool: torch.Tensor) -> int:
    return _per_block_elements(pool) * pool.element_size()


def _page_scale_bytes(scales: torch.Tensor | None) -> int:
    return 0 if scales is None else _page_kv_bytes(scales)


def _per_block_elements(pool: torch.Tensor) -> int:
    """Elements of one page: everything but the page axis (axis 2 of both pools)."""
    return pool.numel() // pool.shape[2]


def _blocks_as_bytes(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    picked = pool.index_select(2, ids)                     # [G, 2, n, ...]
    dims = list(range(picked.dim()))
    per_block = picked.permute(2, *dims[:2], *dims[3:]).contiguous()
    return per_block.view(torch.uint8).reshape(len(ids), -1)


def _bytes_into_blocks(pool: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    shape = (len(ids), pool.shape[0], pool.shape[1], *pool.shape[3:])
    values = rows.contiguous().view(pool.dtype).reshape(shape).to(pool.device)
    dims = list(range(values.dim()))
    pool.index_copy_(2, ids, values.permute(1, 2, 0, *dims[3:]))
