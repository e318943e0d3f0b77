"""Per-step attention metadata for the CPU path, built once and reused by every layer.

The runner calls attention once per layer with the same block tables, so the index tensors
and masks that depend only on the batch shape are computed here, with tensor ops, once.

K/V are gathered a whole block at a time (index_select on the block dimension): fewer
indices and larger contiguous copies than a per-token slot gather. The tail of the last
block is padding and is masked out by the causal mask (its positions are > every query's).

With a sliding window W (a query at p sees keys in (p - W, p]) each sequence's view starts at
the block holding its first visible key: blocks wholly before the window are never read, since
a hybrid KV cache may have given them back to the pool. The native kernels get the same view
as block tables and lengths shifted by whole blocks (positions relative to that first block),
which leaves every query-key distance, and so the window, unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checks import check_lengths, check_metadata, check_window


@dataclass(slots=True)
class DecodeGroup:
    """All sequences with exactly one query token, attended in one padded SDPA call."""

    rows: torch.Tensor  # int64 [S_d]: row of each decode token in the flat query
    blocks: torch.Tensor  # int64 [S_d * nb]: physical blocks to gather, nb per sequence
    num_blocks: int  # nb = blocks per sequence after padding to the longest one
    mask: torch.Tensor  # bool [S_d, 1, 1, nb * B]: True where the key is visible
    tables: torch.Tensor  # int64 [S_d, nb]: block tables from each first visible block on
    lens: torch.Tensor  # int64 [S_d]: context lengths counted from that block


@dataclass(slots=True)
class PrefillChunk:
    """One sequence with several query tokens, attended in its own SDPA call."""

    begin: int  # its rows are query[begin:end]
    end: int
    blocks: torch.Tensor  # int64 [nb]: physical blocks from the first visible one to the end
    context_len: int  # keys 0..context_len-1 of `blocks` exist (seq_len less skipped blocks)
    mask: torch.Tensor | None  # bool [q_len, nb * B] visible keys; None -> plain is_causal


@dataclass(slots=True)
class AttentionPlan:
    block_size: int
    sliding_window: int  # 0: full causal attention
    num_tokens: int  # rows of the flat query this plan was built for
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    # Gather buffers reused by every layer of the step: allocating tens of MB afresh per call
    # costs page faults that, measured, took longer than the gather itself (float32 decode).
    workspace: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A scratch tensor kept for the plan's lifetime (one step), keyed by name/shape/dtype."""
        key = (name, shape, like.dtype, like.device)
        if key not in self.workspace:
            self.workspace[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return self.workspace[key]


def plan_attention(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    sliding_window: int = 0,
) -> AttentionPlan:
    """Precompute gather indices and masks for paged_attention (docs/contracts.md §2).

    sliding_window W > 0: a query at position p sees keys in (p - W, p]; 0: keys 0..p."""
    check_metadata(block_tables, seq_lens, query_start_loc, block_size)
    check_window(sliding_window)
    tables = block_tables.long().cpu()
    seq_lens = seq_lens.long().cpu()
    starts = query_start_loc.long().cpu()
    q_lens = starts[1:] - starts[:-1]
    check_lengths(tables, seq_lens, q_lens, block_size)
    decode_ids = torch.nonzero(q_lens == 1).flatten()
    prefill_ids = torch.nonzero(q_lens > 1).flatten().tolist()  # one entry per sequence, not token
    device = block_tables.device
    decode = _plan_decode(tables, seq_lens, starts, decode_ids, block_size, sliding_window,
                          device)
    prefills = [_plan_prefill(tables[s], int(seq_lens[s]), int(starts[s]), int(starts[s + 1]),
                              block_size, sliding_window, device) for s in prefill_ids]
    return AttentionPlan(block_size=block_size, sliding_window=sliding_window,
                         num_tokens=int(starts[-1]), decode=decode, prefills=prefills)


def first_visible_block(first_query: torch.Tensor, window: int, block_size: int) -> torch.Tensor:
    """Block index (in the sequence) holding the first key a query at first_query+ can see."""
    if window <= 0:
        return torch.zeros_like(first_query)
    return (first_query - window + 1).clamp(min=0) // block_size


def windowed_tables(tables: torch.Tensor, lens: torch.Tensor, first_block: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's table from first_block on, padded with its own last block (a block that
    holds real keys, never a freed one), and its length counted from first_block."""
    last = (lens - 1) // block_size
    width = int((last - first_block).max()) + 1
    columns = torch.minimum(first_block[:, None] + torch.arange(width), last[:, None])
    return tables.gather(1, columns), lens - first_block * block_size


def _plan_decode(tables: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor,
                 ids: torch.Tensor, block_size: int, window: int,
                 device: torch.device) -> DecodeGroup | None:
    if ids.numel() == 0:
        return None
    first_block = first_visible_block(seq_lens[ids] - 1, window, block_size)
    shifted, lens = windowed_tables(tables[ids], seq_lens[ids], first_block, block_size)
    nb = shifted.shape[1]
    key_pos = torch.arange(nb * block_size)[None, :]
    visible = key_pos < lens[:, None]
    if window > 0:
        visible &= key_pos >= lens[:, None] - window
    return DecodeGroup(rows=starts[ids].to(device), blocks=shifted.reshape(-1).to(device),
                       num_blocks=nb, mask=visible.view(len(ids), 1, 1, -1).to(device),
                       tables=shifted.contiguous().to(device), lens=lens.contiguous().to(device))


def _plan_prefill(table: torch.Tensor, seq_len: int, begin: int, end: int, block_size: int,
                  window: int, device: torch.device) -> PrefillChunk:
    q_len = end - begin
    first_block = int(first_visible_block(torch.tensor(seq_len - q_len), window, block_size))
    nb = (seq_len + block_size - 1) // block_size - first_block
    context_len = seq_len - first_block * block_size
    mask = None
    if q_len != context_len or 0 < window < context_len:  # not the plain is_causal case
        query_pos = torch.arange(context_len - q_len, context_len)[:, None]
        key_pos = torch.arange(nb * block_size)[None, :]
        mask = key_pos <= query_pos
        if window > 0:
            mask &= key_pos > query_pos - window
        mask = mask.to(device)
    return PrefillChunk(begin=begin, end=end, blocks=table[first_block:first_block + nb].to(device),
                        context_len=context_len, mask=mask)
