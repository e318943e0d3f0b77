"""The arithmetic of `pagedgen inspect-memory`: what a KV budget holds for one model.

bytes per token = 2 (K and V) x layers x KV heads x head dim x dtype bytes (an 8-bit
kv_cache_dtype: 1-byte codes plus its share of the block's float32 scales, 2 x layers x KV
heads x 4 B per block, rounded up to a whole byte per token); a block holds B tokens; the
pool holds budget // bytes per block blocks. A sequence of L tokens needs ceil(L / B) blocks
with paging, but a static contiguous allocator reserves max_model_len slots for it, whatever L
turns out to be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedgen.validation import require_int
from pagedgen.model.runtime.kv_cache import (blocks_for_budget, dtype_bytes, kv_bytes_per_token,
                                             kv_format, kv_scale_bytes_per_block)


@dataclass(slots=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_cache_dtype: str = "auto"


@dataclass(slots=True)
class PoolSizing:
    shape: KVShape
    dtype_bytes: int
    bytes_per_token: int
    block_size: int
    bytes_per_block: int
    num_blocks: int
    budget_bytes: int          # the bytes asked for (num_blocks x bytes_per_block if given blocks)
    pool_bytes: int            # whole blocks only
    pool_tokens: int
    max_model_len: int
    scale_bytes_per_block: int = 0  # float32 scales of an 8-bit kv_cache_dtype, per block


@dataclass(slots=True)
class SequenceFit:
    seq_len: int
    blocks_per_sequence: int
    paged_sequences: int       # num_blocks // ceil(L / B)
    static_sequences: int      # pool_tokens // max_model_len
    paged_slack_tokens: int    # per sequence: the unused tail of its last block
    static_slack_tokens: int   # per sequence: max_model_len - L


def pool_sizing(shape: KVShape, block_size: int, max_model_len: int,
                kv_memory_bytes: int | None = None, num_blocks: int | None = None) -> PoolSizing:
    """Exactly one of kv_memory_bytes / num_blocks sizes the pool."""
    if (kv_memory_bytes is None) == (num_blocks is None):
        raise ValueError("give exactly one of kv_memory (bytes) or num_blocks")
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        require_int(name, getattr(shape, name))
    require_int("block_size", block_size)
    require_int("max_model_len", max_model_len)
    per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype,
                                   shape.kv_cache_dtype, block_size)
    fmt = kv_format(shape.kv_cache_dtype)
    element_bytes = dtype_bytes(shape.dtype) if fmt is None else fmt.storage.itemsize
    scale_bytes = 0 if fmt is None else kv_scale_bytes_per_block(shape.num_layers, shape.num_kv_heads)
    per_block = per_token * block_size
    if num_blocks is None:
        require_int("kv_memory", kv_memory_bytes)
        num_blocks = blocks_for_budget(kv_memory_bytes, block_size, per_token)
    else:
        require_int("num_blocks", num_blocks)
    budget = kv_memory_bytes if kv_memory_bytes is not None else num_blocks * per_block
    return PoolSizing(shape, element_bytes, per_token, block_size, per_block, num_blocks,
                      budget, num_blocks * per_block, num_blocks * block_size, max_model_len,
                      scale_bytes)


def sequence_fit(sizing: PoolSizing, seq_len: int) -> SequenceFit:
    require_int("seq_len", seq_len)
    if seq_len > sizing.max_model_len:
        raise ValueError(f"seq_len {seq_len} is longer than max_model_len {sizing.max_model_len}")
    blocks = -(-seq_len // sizing.block_size)
    return SequenceFit(seq_len, blocks, sizing.num_blocks // blocks,
                       sizing.pool_tokens // sizing.max_model_len,
                       blocks * sizing.block_size - seq_len, sizing.max_model_len - seq_len)


def sizing_dict(sizing: PoolSizing, seq_lens: Sequence[int], model: str | None = None) -> dict[str, Any]:
    """The JSON of `inspect-memory --json`."""
    return {"model": model, **asdict(sizing),
            "fits": [asdict(sequence_fit(sizing, length)) for length in seq_lens]}


@dataclass(slots=True)
class ModelShape:
    """What sizing needs from a model's config; read without loading any weights."""
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int


def read_model_shape(model: str | Path | None) -> ModelShape:
    """model: None (the built-in default), an HF folder, a .gguf file or a folder with one.

    Goes through the loader's own resolution and config parsing (model/source.py), so the
    shape and the usable length (sliding-window cap included) are the ones a run would use.
    """
    from pagedgen.model.loading.source import locate_model, read_model_config

    source = locate_model(model)
    config = read_model_config(source)
    return ModelShape(source.name, config.num_layers, config.num_kv_heads, config.head_dim,
                      config.max_position_embeddings)
