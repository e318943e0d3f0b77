"""Argument checks shared by the kernel implementations: bad input names its argument.

Shape checks are cheap and run on every call; value checks (lengths vs tables) read the
metadata and run once per step, when a plan is built.
"""
from __future__ import annotations

from torch import Tensor


def check_store_args(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                     slot_mapping: Tensor) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [T, H_kv, D], got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"k_cache/v_cache must be [N, B, {key.shape[1]}, {key.shape[2]}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (writes go through a flat view)")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must have shape ({key.shape[0]},), "
                         f"got {tuple(slot_mapping.shape)}")


def check_copy_args(kv_cache: Tensor, src: Tensor, dst: Tensor) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [L, 2, N, B, H, D], "
                         f"got shape {tuple(kv_cache.shape)}")
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src and dst must be 1-D of equal length, got {tuple(src.shape)} "
                         f"and {tuple(dst.shape)}")


def check_attention_args(query: Tensor, k_cache: Tensor,
                         v_cache: Tensor) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [T, H_q, D], got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [N, B, H_kv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if query.shape[2] != head_dim:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {head_dim}")
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of kv heads "
                         f"({num_kv_heads})")


def check_plan_fits(block_size: int, num_tokens: int, query: Tensor,
                    k_cache: Tensor) -> None:
    if block_size != k_cache.shape[1]:
        raise ValueError(f"plan was built for block_size {block_size}, "
                         f"k_cache has {k_cache.shape[1]}")
    if num_tokens != query.shape[0]:
        raise ValueError(f"query has {query.shape[0]} tokens but query_start_loc[-1] "
                         f"(the plan's) is {num_tokens}")


def check_window(sliding_window: int) -> None:
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
            or sliding_window < 0:
        raise ValueError(f"sliding_window must be an int >= 0 (0: full attention), "
                         f"got {sliding_window!r}")


def check_plan_window(planned: int, asked: int) -> None:
    if planned != asked:
        raise ValueError(f"plan was built for sliding_window {planned}, "
                         f"paged_attention was given {asked}")


def check_metadata(block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                   block_size: int) -> None:
    """Shapes only: block_size itself is a checked setting (pagedgen/settings), and
    check_plan_fits holds the plan to the pool's real block size."""
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], "
                         f"got shape {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must have shape ({num_seqs},), got {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must have shape ({num_seqs + 1},), "
                         f"got {tuple(query_start_loc.shape)}")


def check_lengths(tables: Tensor, seq_lens: Tensor, q_lens: Tensor,
                  block_size: int) -> None:
    if bool((q_lens < 0).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    if bool((q_lens > seq_lens).any()):
        raise ValueError("seq_lens must be >= each sequence's query length "
                         "(query_start_loc diff)")
    if bool((seq_lens > tables.shape[1] * block_size).any()):
        raise ValueError(f"seq_lens exceed block_tables capacity ({tables.shape[1]} blocks "
                         f"of {block_size})")
