"""`pagedgen inspect-memory` without --report: what a KV budget holds for one model.

bytes per token = 2 (K and V) x layers x KV heads x head dim x dtype bytes (an 8-bit
kv_cache_dtype: 1-byte codes plus its share of the block's float32 scales, 2 x layers x KV
heads x 4 B per block, rounded up to a whole byte per token); a block holds B tokens; the pool holds budget // bytes per block blocks. A sequence of L tokens needs
ceil(L / B) blocks with paging, but a static contiguous allocator reserves max_model_len slots
for it, whatever L turns out to be. The pool is sized by the runner's own rule
(model/runtime/kv_cache.py: size_kv_pool), defaults included; nothing is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from pagedgen.engine.engine_config import resolve_max_model_len
from pagedgen.memory.render import human_bytes
from pagedgen.model.device import resolve_device
from pagedgen.model.dtypes import resolve_dtype
from pagedgen.model.loading.source import locate_model, read_model_config
from pagedgen.model.runtime.kv_cache import (dtype_bytes, kv_bytes_per_token, kv_format,
                                             kv_scale_bytes_per_block, size_kv_pool)
from pagedgen.validation import require_int

DEFAULT_SEQ_LENS = (256, 1024, 4096)


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
    budget_source: str         # where the size came from (a flag, the config, the default)
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
                kv_memory_bytes: int | None = None, num_blocks: int | None = None,
                device: str = "cpu") -> PoolSizing:
    """At most one of kv_memory_bytes / num_blocks sizes the pool; neither: the device's default."""
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        require_int(name, getattr(shape, name))
    require_int("max_model_len", max_model_len)
    per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype,
                                   shape.kv_cache_dtype, block_size)
    fmt = kv_format(shape.kv_cache_dtype)
    element_bytes = dtype_bytes(shape.dtype) if fmt is None else fmt.storage.itemsize
    scale_bytes = 0 if fmt is None else kv_scale_bytes_per_block(shape.num_layers, shape.num_kv_heads)
    pool = size_kv_pool(bytes_per_token=per_token, block_size=block_size, device=device,
                        num_blocks=num_blocks, kv_memory_bytes=kv_memory_bytes, check_available=False)
    per_block = per_token * block_size
    return PoolSizing(shape, element_bytes, per_token, block_size, per_block, pool.num_blocks,
                      pool.budget_bytes, pool.num_blocks * per_block, pool.num_blocks * block_size,
                      max_model_len, pool.source, scale_bytes)


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

    Goes through the loader's own resolution and config parsing (model/loading/source.py), so the
    shape and the usable length (sliding-window cap included) are the ones a run would use.
    """
    source = locate_model(model)
    config = read_model_config(source)
    return ModelShape(source.name, config.num_layers, config.num_kv_heads, config.head_dim,
                      config.max_position_embeddings)

def sizing_for_config(config: Any, seq_lens: Sequence[int] = ()) -> dict[str, Any]:
    """config: a RunConfig (model, dtype, device, block_size, kv_memory | num_blocks, max_model_len)."""
    device = resolve_device(config.device)
    shape = read_model_shape(config.model)
    dtype = str(resolve_dtype(None if config.dtype == "auto" else config.dtype, device)).removeprefix("torch.")
    kv = KVShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype,
                 config.kv_cache_dtype)
    size = dict(kv_memory_bytes=config.kv_memory, num_blocks=config.num_blocks, device=device)
    probe = pool_sizing(kv, config.block_size, shape.max_position_embeddings, **size)
    max_model_len = resolve_max_model_len(config.max_model_len, shape.max_position_embeddings,
                                          probe.pool_tokens)   # the rule LLM follows
    sizing = pool_sizing(kv, config.block_size, max_model_len, **size)
    lengths = list(seq_lens) or [n for n in DEFAULT_SEQ_LENS if n < max_model_len] + [max_model_len]
    return {**sizing_dict(sizing, lengths, shape.name), "device": device}


def sizing_renderable(d: dict[str, Any]) -> RenderableType:
    s = d["shape"]
    facts = Table(title=f"KV cache sizing — {d['model']}", show_header=False, title_justify="left")
    facts.add_column(style="bold")
    facts.add_column()
    per_token = (f"2 x {s['num_layers']} layers x {s['num_kv_heads']} KV heads x {s['head_dim']} "
                 f"head dim x {d['dtype_bytes']} B ({s['dtype']}) = {d['bytes_per_token']:,} B")
    if d.get("scale_bytes_per_block"):
        per_token = (f"2 x {s['num_layers']} layers x {s['num_kv_heads']} KV heads x "
                     f"{s['head_dim']} head dim x 1 B ({s['kv_cache_dtype']} codes) + "
                     f"{d['scale_bytes_per_block']:,} B of float32 scales per block / "
                     f"{d['block_size']} tokens, rounded up = {d['bytes_per_token']:,} B")
    for key, value in (
        ("bytes per token", per_token),
        ("bytes per block", f"{d['block_size']} tokens x {d['bytes_per_token']:,} B = "
                            f"{d['bytes_per_block']:,} B ({human_bytes(d['bytes_per_block'])})"),
        ("budget", f"{human_bytes(d['budget_bytes'])} ({d['budget_source']})"),
        ("blocks", f"{d['num_blocks']:,} ({human_bytes(d['pool_bytes'])})"),
        ("tokens", f"{d['pool_tokens']:,}"),
        ("max_model_len", f"{d['max_model_len']:,}"),
    ):
        facts.add_row(key, value)
    fits = Table(title="Sequences that fit", title_justify="left")
    for name in ("seq len", "blocks each", "paged", "static at max_model_len", "paged / static"):
        fits.add_column(name, justify="right")
    for f in d["fits"]:
        ratio = f"{f['paged_sequences'] / f['static_sequences']:.1f}x" if f["static_sequences"] else "inf"
        fits.add_row(f"{f['seq_len']:,}", str(f["blocks_per_sequence"]), f"{f['paged_sequences']:,}",
                     f"{f['static_sequences']:,}", ratio)
    return Group(facts, fits)
