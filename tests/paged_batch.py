"""Random paged-attention inputs for tests and benchmarks.

Blocks are handed out in a random order, the unused blocks are filled with random data too,
and padded block-table entries are 0 (a block that may belong to another sequence), so a
kernel that reads through the wrong table entry or past seq_len gives a wrong answer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [T, H_q, D]
    k_cache: torch.Tensor  # [N, B, H_kv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]

    def attention_args(self) -> tuple:
        """Positional arguments of paged_attention, minus scale."""
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc)


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
    seed: int = 0,
) -> PagedBatch:
    """A batch where sequence s has seq_lens[s] tokens in the cache and q_lens[s] queries."""
    if len(seq_lens) != len(q_lens):
        raise ValueError("seq_lens and q_lens must have the same length")
    if any(q > n for q, n in zip(q_lens, seq_lens)):
        raise ValueError("each q_len must be <= its seq_len")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    tables = _random_block_tables(blocks_per_seq, num_blocks, gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    return PagedBatch(
        query=_randn((int(starts[-1]), num_q_heads, head_dim), gen, dtype, device),
        k_cache=_randn(cache_shape, gen, dtype, device),
        v_cache=_randn(cache_shape, gen, dtype, device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(torch.int32).to(device),
    )


def _random_block_tables(blocks_per_seq: list[int], num_blocks: int,
                         gen: torch.Generator) -> torch.Tensor:
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(blocks_per_seq), max(blocks_per_seq, default=0) + 1,
                         dtype=torch.int32)  # one extra padded column, as real tables have
    taken = 0
    for s, count in enumerate(blocks_per_seq):  # per sequence, not per token
        tables[s, :count] = order[taken:taken + count]
        taken += count
    return tables


def _randn(shape, gen, dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
