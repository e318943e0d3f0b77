"""ScheduledChunk (what the scheduler asks for) -> the flat-batch tensors of one forward.

All per-token metadata (positions, slots) is derived with tensor ops from per-sequence
values; the only Python loops run once per chunk, never once per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch


@dataclass(slots=True)
class ScheduledChunk:
    token_ids: list[int]  # tokens to compute now (prefill chunk or the 1 decode token)
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_table: list[int]  # covers start_pos + len(token_ids) tokens
    sample: bool  # True when logits are needed at the chunk's last token
    prompt_logprobs: bool = False  # the hidden states of every token are kept (runner.prompt_hidden)
    # Hybrid KV cache: every layer group's table (block_table is group 0's); entries a sliding
    # window released are negative (the manager's NULL_BLOCK) and become padding here.
    group_tables: list[list[int]] | None = None


@dataclass(slots=True)
class FlatBatch:
    """CPU tensors describing one step; sequence s owns rows query_start_loc[s]:[s+1]."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with 0
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    sample_rows: torch.Tensor  # int64 [number of chunks with sample=True]
    group_block_tables: torch.Tensor | None = None  # int32 [groups, S, max_blocks] (hybrid)
    group_slot_mapping: torch.Tensor | None = None  # int64 [groups, T] (hybrid)


def build_flat_batch(chunks: list[ScheduledChunk], block_size: int) -> FlatBatch:
    if not chunks:
        raise ValueError("batch must hold at least one ScheduledChunk")
    q_lens = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64)
    starts = torch.tensor([c.start_pos for c in chunks], dtype=torch.int64)
    tables = _padded_block_tables(chunks)
    seq_lens = starts + q_lens
    _check_chunks(chunks, q_lens, starts, seq_lens, block_size)
    query_start_loc = torch.cat((torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)))
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), q_lens)
    # position = start_pos of the token's sequence + its offset inside the chunk
    offsets = torch.arange(int(query_start_loc[-1])) - query_start_loc[:-1][seq_of_token]
    positions = starts[seq_of_token] + offsets
    blocks = tables[seq_of_token, positions // block_size].long()
    sampled = torch.tensor([c.sample for c in chunks], dtype=torch.bool)
    group_tables = group_slots = None
    if chunks[0].group_tables is not None:
        group_tables = _padded_group_tables(chunks)
        # Every group's slots in one gather: [groups, T].
        group_blocks = group_tables[:, seq_of_token, positions // block_size].long()
        group_slots = group_blocks * block_size + positions % block_size
    return FlatBatch(
        input_ids=torch.tensor(list(chain.from_iterable(c.token_ids for c in chunks)), dtype=torch.int64),
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        block_tables=tables,
        seq_lens=seq_lens.to(torch.int32),
        query_start_loc=query_start_loc.to(torch.int32),
        sample_rows=(query_start_loc[1:] - 1)[sampled],
        group_block_tables=group_tables,
        group_slot_mapping=group_slots,
    )


def _padded_block_tables(chunks: list[ScheduledChunk]) -> torch.Tensor:
    """int32 [S, longest table], rows filled left to right through one boolean-mask write."""
    lengths = torch.tensor([len(c.block_table) for c in chunks], dtype=torch.int64)
    width = max(int(lengths.max()), 1)
    tables = torch.zeros(len(chunks), width, dtype=torch.int32)
    filled = torch.arange(width)[None, :] < lengths[:, None]
    tables[filled] = torch.tensor(list(chain.from_iterable(c.block_table for c in chunks)),
                                  dtype=torch.int32)
    return tables.clamp_(min=0)  # released (sliding-window) entries read as padding


def _padded_group_tables(chunks: list[ScheduledChunk]) -> torch.Tensor:
    """int32 [groups, S, longest table]; all groups' tables of a chunk have the same length."""
    lengths = torch.tensor([len(c.block_table) for c in chunks], dtype=torch.int64)
    groups = len(chunks[0].group_tables)
    width = max(int(lengths.max()), 1)
    tables = torch.zeros(len(chunks), groups, width, dtype=torch.int32)
    filled = (torch.arange(width)[None, :] < lengths[:, None])[:, None, :].expand(-1, groups, -1)
    values = chain.from_iterable(chain.from_iterable(c.group_tables for c in chunks))
    tables[filled] = torch.tensor(list(values), dtype=torch.int32)
    return tables.clamp_(min=0).transpose(0, 1).contiguous()


def _check_chunks(chunks, q_lens, starts, seq_lens, block_size) -> None:
    _first_bad(q_lens < 1, chunks, "token_ids must not be empty")
    _first_bad(starts < 0, chunks, "start_pos must be >= 0")
    capacity = torch.tensor([len(c.block_table) for c in chunks]) * block_size
    _first_bad(capacity < seq_lens, chunks,
               f"block_table (blocks of {block_size} tokens) must cover start_pos + len(token_ids)")


def _first_bad(bad: torch.Tensor, chunks: list[ScheduledChunk], requirement: str) -> None:
    if bool(bad.any()):
        index = int(bad.nonzero()[0])
        chunk = chunks[index]
        raise ValueError(f"ScheduledChunk #{index}: {requirement} (start_pos={chunk.start_pos}, "
                         f"{len(chunk.token_ids)} token_ids, {len(chunk.block_table)} blocks)")
