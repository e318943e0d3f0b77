"""Per-step attention metadata for the CPU path, built once and reused by every layer.

The runner calls attention once per layer with the same block tables, so the index tensors
and masks that depend only on the batch shape are computed here, with tensor ops, once.

K/V are gathered a whole block at a time (index_select on the block dimension): fewer
indices and larger contiguous copies than a per-token slot gather. The tail of the last
block is padding and is masked out by the causal mask (its positions are > every query's).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .checks import check_lengths, check_metadata


@dataclass(slots=True)
class DecodeGroup:
    """All sequences with exactly one query token, attended in one padded SDPA call."""

    rows: torch.Tensor  # int64 [S_d]: row of each decode token in the flat query
    blocks: torch.Tensor  # int64 [S_d * nb]: physical blocks to gather, nb per sequence
    num_blocks: int  # nb = blocks per sequence after padding to the longest one
    mask: torch.Tensor  # bool [S_d, 1, 1, nb * B]: True where the key is inside the sequence
    tables: torch.Tensor  # int64 [S_d, nb]: the decode sequences' block tables (native kernel)
    lens: torch.Tensor  # int64 [S_d]: their context lengths


@dataclass(slots=True)
class PrefillChunk:
    """One sequence with several query tokens, attended in its own SDPA call."""

    begin: int  # its rows are query[begin:end]
    end: int
    blocks: torch.Tensor  # int64 [nb]: physical blocks covering its context
    context_len: int  # seq_len: keys 0..context_len-1 exist
    mask: torch.Tensor | None  # bool [q_len, nb * B] causal mask; None -> plain is_causal


@dataclass(slots=True)
class AttentionPlan:
    block_size: int
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
) -> AttentionPlan:
    """Precompute gather indices and masks for paged_attention (docs/contracts.md §2)."""
    check_metadata(block_tables, seq_lens, query_start_loc, block_size)
    tables = block_tables.long().cpu()
    seq_lens = seq_lens.long().cpu()
    starts = query_start_loc.long().cpu()
    q_lens = starts[1:] - starts[:-1]
    check_lengths(tables, seq_lens, q_lens, block_size)
    decode_ids = torch.nonzero(q_lens == 1).flatten()
    prefill_ids = torch.nonzero(q_lens > 1).flatten().tolist()  # one entry per sequence, not token
    device = block_tables.device
    decode = _plan_decode(tables, seq_lens, starts, decode_ids, block_size, device)
    prefills = [_plan_prefill(tables[s], int(seq_lens[s]), int(starts[s]), int(starts[s + 1]),
                              block_size, device) for s in prefill_ids]
    return AttentionPlan(block_size=block_size, num_tokens=int(starts[-1]), decode=decode,
                         prefills=prefills)


def _plan_decode(tables: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor,
                 ids: torch.Tensor, block_size: int,
                 device: torch.device) -> DecodeGroup | None:
    if ids.numel() == 0:
        return None
    lens = seq_lens[ids]
    nb = int((lens.max() + block_size - 1) // block_size)
    blocks = tables[ids, :nb].reshape(-1)  # padded entries are 0: a real block, masked below
    key_pos = torch.arange(nb * block_size)
    mask = (key_pos[None, :] < lens[:, None]).view(len(ids), 1, 1, -1)
    return DecodeGroup(rows=starts[ids].to(device), blocks=blocks.to(device), num_blocks=nb,
                       mask=mask.to(device), tables=tables[ids, :nb].contiguous().to(device),
                       lens=lens.contiguous().to(device))


def _plan_prefill(table: torch.Tensor, seq_len: int, begin: int, end: int, block_size: int,
                  device: torch.device) -> PrefillChunk:
    nb = (seq_len + block_size - 1) // block_size
    q_len = end - begin
    mask = None
    if q_len != seq_len:  # cached context before the chunk: causal diagonal is shifted
        query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = (torch.arange(nb * block_size)[None, :] <= query_pos).to(device)
    return PrefillChunk(begin=begin, end=end, blocks=table[:nb].to(device),
                        context_len=seq_len, mask=mask)
