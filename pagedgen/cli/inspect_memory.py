"""`pagedgen inspect-memory` without --report: what a KV budget holds for one model.

bytes per token = 2 (K and V) x layers x KV heads x head dim x dtype bytes (an 8-bit
kv_cache_dtype: 1-byte codes plus its share of the block's float32 scales, 2 x layers x KV
heads x 4 B per block, rounded up to a whole byte per token); a block holds B tokens; the pool holds budget // bytes per block blocks. A sequence of L tokens needs
ceil(L / B) blocks with paging, but a static contiguous allocator reserves max_model_len slots
for it, whatever L turns out to be. The pool is sized by the runner's own rule
(model/runtime/kv_cache.py: size_kv_pool), defaults included; nothing is allocated.

A model with sliding-window layers gets a hybrid pool (model/runtime/kv_groups.py): pages of G
layers, one row per layer group, a sliding group holding only its window's blocks; the sizing
then also shows the counterfactual "every layer full attention" (one group of every layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from pagedgen.engine.engine_config import resolve_max_model_len
from pagedgen.memory.render import human_bytes
from pagedgen.model.device import resolve_device
from pagedgen.model.dtypes import resolve_dtype
from pagedgen.model.loading.loader import stays_packed
from pagedgen.model.loading.source import locate_model, read_model_config
from pagedgen.model.loading.weight_sizes import weight_file_sizes
from pagedgen.model.runtime.kv_cache import (available_memory_bytes, dtype_bytes,
                                             kv_bytes_per_token, kv_format,
                                             kv_scale_bytes_per_block, size_kv_pool)
from pagedgen.model.runtime.kv_groups import (group_layers_by_window, longest_sequence,
                                             pages_for_tokens)
from pagedgen.settings import default
from pagedgen.validation import require_int

DEFAULT_SEQ_LENS = (256, 1024, 4096)


@dataclass(slots=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_cache_dtype: str = default("kv_cache_dtype")
    layer_windows: tuple[int, ...] = ()  # per layer its sliding window, 0 = full; empty: all full


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
    # A hybrid pool: a block is a page of G layers; one entry per layer group.
    groups: list[dict[str, int]] | None = None
    full_attention_bytes_per_token: int = 0  # every layer keeping every token
    page_layers: int = 0  # layers one block (page) holds: G for a hybrid pool, else all


@dataclass(slots=True)
class SequenceFit:
    seq_len: int
    blocks_per_sequence: int
    paged_sequences: int       # num_blocks // ceil(L / B)
    static_sequences: int      # pool_tokens // max_model_len
    paged_slack_tokens: int    # per sequence: the unused tail of its last block
    static_slack_tokens: int   # per sequence: max_model_len - L
    full_attention_sequences: int = 0  # hybrid: the same bytes with every layer full attention
    blocks_freed_by_window: int = 0    # hybrid: blocks the sliding groups no longer hold


def pool_sizing(shape: KVShape, block_size: int, max_model_len: int,
                kv_memory_bytes: int | None = None, num_blocks: int | None = None,
                device: str | None = None) -> PoolSizing:
    """At most one of kv_memory_bytes / num_blocks sizes the pool; neither: the device's default
    (device None or "auto": CUDA when available, else CPU)."""
    device = resolve_device(device)
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        require_int(name, getattr(shape, name))
    require_int("max_model_len", max_model_len)
    layout = group_layers_by_window(shape.layer_windows or (0,) * shape.num_layers)
    page_layers = layout.group_size   # = num_layers without sliding layers
    full_per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                        shape.dtype, shape.kv_cache_dtype, block_size)
    per_token = kv_bytes_per_token(page_layers, shape.num_kv_heads, shape.head_dim, shape.dtype,
                                   shape.kv_cache_dtype, block_size)
    fmt = kv_format(shape.kv_cache_dtype)
    element_bytes = dtype_bytes(shape.dtype) if fmt is None else fmt.storage.itemsize
    scale_bytes = 0 if fmt is None else kv_scale_bytes_per_block(page_layers, shape.num_kv_heads)
    groups = None
    if layout.is_hybrid:
        groups = [{"group": g, "window": w, "layers": len(layout.group_layers(g)),
                   "bytes_per_token": per_token} for g, w in enumerate(layout.group_windows)]
    pool = size_kv_pool(bytes_per_token=per_token, block_size=block_size, device=device,
                        num_blocks=num_blocks, kv_memory_bytes=kv_memory_bytes, check_available=False)
    per_block = per_token * block_size
    return PoolSizing(shape, element_bytes, per_token, block_size, per_block, pool.num_blocks,
                      pool.budget_bytes, pool.num_blocks * per_block, pool.num_blocks * block_size,
                      max_model_len, pool.source, scale_bytes, groups, full_per_token,
                      page_layers)


def sequence_fit(sizing: PoolSizing, seq_len: int) -> SequenceFit:
    require_int("seq_len", seq_len)
    if seq_len > sizing.max_model_len:
        raise ValueError(f"seq_len {seq_len} is longer than max_model_len {sizing.max_model_len}")
    spanned = -(-seq_len // sizing.block_size)
    if not sizing.groups:
        return SequenceFit(seq_len, spanned, sizing.num_blocks // spanned,
                           sizing.pool_tokens // sizing.max_model_len,
                           spanned * sizing.block_size - seq_len, sizing.max_model_len - seq_len)
    # Hybrid: pages held while decoding at length L (sliding groups: their window's blocks).
    windows = [g["window"] for g in sizing.groups]
    blocks = pages_for_tokens(windows, seq_len, sizing.block_size)
    full_bytes = spanned * sizing.block_size * sizing.full_attention_bytes_per_token
    all_layers_token = sizing.full_attention_bytes_per_token
    return SequenceFit(seq_len, blocks, sizing.num_blocks // blocks,
                       sizing.pool_bytes // (sizing.max_model_len * all_layers_token),
                       spanned * sizing.block_size - seq_len, sizing.max_model_len - seq_len,
                       sizing.pool_bytes // full_bytes, spanned * len(windows) - blocks)


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
    layer_windows: tuple[int, ...] = ()


def read_model_shape(model: str | Path | None) -> ModelShape:
    """model: None (the built-in default), an HF folder, a .gguf file or a folder with one.

    Goes through the loader's own resolution and config parsing (model/loading/source.py), so the
    shape and the usable length (sliding-window cap included) are the ones a run would use.
    """
    source = locate_model(model)
    config = read_model_config(source)
    windows = tuple(config.window_of(layer) for layer in range(config.num_layers))
    return ModelShape(source.name, config.num_layers, config.num_kv_heads, config.head_dim,
                      config.max_position_embeddings, windows if any(windows) else ())

def sizing_for_config(config: Any, seq_lens: Sequence[int] = ()) -> dict[str, Any]:
    """config: a RunConfig; its engine settings (model, dtype, device, block_size, kv_memory |
    num_blocks, kv_cache_dtype, max_model_len) size the pool."""
    config = config.engine
    device = resolve_device(config.device)
    shape = read_model_shape(config.model)
    source = locate_model(config.model)
    dtype = str(resolve_dtype(None if config.dtype == "auto" else config.dtype, device,
                              lambda: stays_packed(source, config.weights, device))
                ).removeprefix("torch.")
    kv = KVShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype,
                 config.kv_cache_dtype, shape.layer_windows)
    size = dict(kv_memory_bytes=config.kv_memory, num_blocks=config.num_blocks, device=device)
    probe = pool_sizing(kv, config.block_size, shape.max_position_embeddings, **size)
    # The rule LLM follows (engine/builder.py): the longest sequence the pool holds alone. In a
    # hybrid pool that is not its token count: full groups take a page per block, sliding groups
    # only their window's.
    windows = [g["window"] for g in probe.groups] if probe.groups else [0]
    pool_tokens = longest_sequence(windows, probe.num_blocks, config.block_size,
                                   config.max_num_batched_tokens, shape.max_position_embeddings)
    max_model_len = resolve_max_model_len(config.max_model_len, shape.max_position_embeddings,
                                          pool_tokens)
    sizing = pool_sizing(kv, config.block_size, max_model_len, **size)
    lengths = list(seq_lens) or [n for n in DEFAULT_SEQ_LENS if n < max_model_len] + [max_model_len]
    return {**sizing_dict(sizing, lengths, shape.name), "device": device,
            "weights": weights_dict(source, dtype, device)}


def weights_dict(source: Any, dtype: str, device: str) -> dict[str, Any]:
    """The weights' bytes as stored and dequantized to the run's dtype, and the memory they
    leave for the KV pool (what is free now, less the weights)."""
    sizes = weight_file_sizes(source)
    dequantized = sizes.parameters * dtype_bytes(dtype)
    available = available_memory_bytes(device)
    held = {"dequantized": dequantized}
    if source.kind == "gguf":   # --weights packed holds the blocks as stored
        held = {"packed": sizes.stored_bytes, **held}
    return {"format": source.kind, "stored_bytes": sizes.stored_bytes,
            "parameters": sizes.parameters, "dequantized_bytes": dequantized, "dtype": dtype,
            "available_bytes": available,
            "left_for_kv": {how: available - size for how, size in held.items()}}


def sizing_renderable(d: dict[str, Any]) -> RenderableType:
    s = dict(d["shape"])
    if d.get("groups"):  # a block is a page of one group's layers
        s["num_layers"] = f"{d['page_layers']} (of {s['num_layers']}, one group's)"
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
    hybrid = bool(d.get("groups"))
    if hybrid:
        facts.add_row("layer groups", _groups_text(d))
    if d.get("weights"):
        facts.add_row("weights", _weights_text(d["weights"]))
    fits = Table(title="Sequences that fit", title_justify="left")
    columns = ["seq len", "blocks each", "paged", "static at max_model_len", "paged / static"]
    if hybrid:
        columns += ["every layer full attention", "blocks freed by the window"]
    for name in columns:
        fits.add_column(name, justify="right")
    for f in d["fits"]:
        ratio = f"{f['paged_sequences'] / f['static_sequences']:.1f}x" if f["static_sequences"] else "inf"
        row = [f"{f['seq_len']:,}", str(f["blocks_per_sequence"]), f"{f['paged_sequences']:,}",
               f"{f['static_sequences']:,}", ratio]
        if hybrid:
            row += [f"{f['full_attention_sequences']:,}", f"{f['blocks_freed_by_window']:,}"]
        fits.add_row(*row)
    if d.get("weights"):
        return Group(facts, Text(free_memory_line(d["weights"])), fits)
    return Group(facts, fits)


def _weights_text(w: dict[str, Any]) -> str:
    stored = "GGUF blocks" if w["format"] == "gguf" else "safetensors"
    return (f"{human_bytes(w['stored_bytes'])} as stored ({stored}), "
            f"{human_bytes(w['dequantized_bytes'])} as {w['dtype']} ({w['parameters']:,} parameters)")


def free_memory_line(w: dict[str, Any]) -> str:
    """What is free now and what the weights leave of it for KV (a line of its own: it changes
    from one moment to the next)."""
    left = ", ".join(f"{human_bytes(size)} {how}" for how, size in w["left_for_kv"].items())
    return f"free now {human_bytes(w['available_bytes'])}; left for KV {left}"


def _groups_text(d: dict[str, Any]) -> str:
    """One line per group: its kind, layers and bytes per token of its pages."""
    lines = [f"group {g['group']}: {'window ' + format(g['window'], ',') if g['window'] else 'full'}"
             f", {g['layers']} layers, {g['bytes_per_token']:,} B/token"
             for g in d["groups"]]
    lines.append(f"every layer full attention: {d['full_attention_bytes_per_token']:,} B/token")
    return "\n".join(lines)


# --- --report: what is read is checked before it is shown ---

def checked_report(path: Path, step: int | None, request: str | None, sample: int) -> dict[str, Any]:
    """The memory report at `path`, refused (ValueError) when it is of another report version,
    or when --sample names a sample the request does not have (it would silently show
    another sample's blocks)."""
    from pagedgen.memory.block_map import recorded_tables
    from pagedgen.memory.inspect_report import load_report
    from pagedgen.memory.report import REPORT_VERSION

    report = load_report(path)
    version = report.get("version")
    if version != REPORT_VERSION:
        raise ValueError(f"--report {path}: report version {version!r}, but this pagedgen reads "
                         f"version {REPORT_VERSION}; write it again with this version")
    if sample != 0 and request is None:
        raise ValueError("--sample needs --request (whose sample)")
    if request is not None:
        samples = sorted({s["sample_index"] for s in recorded_tables(report, step)["sequences"]
                          if s["request_id"] == request})
        if samples and sample not in samples:
            raise ValueError(f"--sample {sample}: request {request!r} has sample(s) "
                             f"{', '.join(map(str, samples))} holding blocks at this step")
    return report
