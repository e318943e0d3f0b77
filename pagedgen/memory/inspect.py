"""`pagedgen inspect-memory`: the sizing of a model's KV pool, or the pool map of a report.

The CLI parses and prints; this module decides what to compute and returns plain dicts (for
--json) next to Rich renderables (for people).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from pagedgen.defaults import default_kv_memory
from pagedgen.memory.block_map import build_pool_map, recorded_tables, token_address
from pagedgen.memory.render import human_bytes
from pagedgen.memory.render_map import address_table, block_tables_table, pool_map_renderable
from pagedgen.memory.sizing import KVShape, pool_sizing, read_model_shape, sizing_dict

DEFAULT_SEQ_LENS = (256, 1024, 4096)


def _device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name in (None, "auto") else name


def _budget(config: Any, device: str) -> tuple[int | None, str]:
    """(kv_memory bytes or None when num_blocks sizes the pool, where it came from).

    Without a size, the same default as LLM (pagedgen/defaults.py): a fixed budget on CPU, the
    runner's share of free memory on CUDA."""
    if config.num_blocks is not None:
        return None, f"num_blocks={config.num_blocks}"
    if config.kv_memory is not None:
        return config.kv_memory, f"kv_memory={human_bytes(config.kv_memory)}"
    device_type = device.split(":")[0]
    default = default_kv_memory(device_type)
    if default is not None:
        return default, f"default on {device_type}"
    from pagedgen.model.runtime.kv_cache import DEFAULT_KV_MEMORY_FRACTION, available_memory_bytes

    fraction = DEFAULT_KV_MEMORY_FRACTION[device_type]
    free = available_memory_bytes(device)
    return int(free * fraction), f"{fraction:.0%} of {human_bytes(free)} free on {device} (run's default)"


def sizing_for_config(config: Any, seq_lens: Sequence[int] = ()) -> dict[str, Any]:
    """config: a RunConfig (model, dtype, device, block_size, kv_memory | num_blocks, max_model_len)."""
    from pagedgen.model.dtypes import resolve_dtype

    device = _device(config.device)
    shape = read_model_shape(config.model)
    dtype = str(resolve_dtype(None if config.dtype == "auto" else config.dtype, device)).removeprefix("torch.")
    budget, source = _budget(config, device)
    kv = KVShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype,
                 config.kv_cache_dtype)
    probe = pool_sizing(kv, config.block_size, shape.max_position_embeddings, budget, config.num_blocks)
    # The same rule as LLM: the model's length, capped by what the pool can hold at all.
    max_model_len = config.max_model_len or min(shape.max_position_embeddings, probe.pool_tokens)
    sizing = pool_sizing(kv, config.block_size, max_model_len, budget, config.num_blocks)
    lengths = list(seq_lens) or [n for n in DEFAULT_SEQ_LENS if n < max_model_len] + [max_model_len]
    return {**sizing_dict(sizing, lengths, shape.name), "budget_source": source, "device": device}


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


def load_report(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--report {path}: cannot read a memory report: {exc}") from None
    if not isinstance(report, dict) or "pool" not in report or "peak_block_tables" not in report:
        raise ValueError(f"--report {path}: not a pagedgen memory report (no pool / peak_block_tables)")
    return report


def inspect_report(report: dict[str, Any], step: int | None = None, request: str | None = None,
                   sample: int = 0, token: int | None = None,
                   width: int = 100) -> tuple[dict[str, Any], RenderableType]:
    """The pool map (and a request's table, and a token's address) as (json dict, renderable)."""
    if token is not None and request is None:
        raise ValueError("--token needs --request (whose token)")
    pool_map = build_pool_map(report, step)
    tables = recorded_tables(report, step)
    sequences = [s for s in tables["sequences"] if request is None or s["request_id"] == request]
    if request is not None and not sequences:
        live = sorted({str(s["request_id"]) for s in tables["sequences"]})
        raise ValueError(f"--request {request!r} holds no blocks at step {tables['step']}; "
                         f"live then: {', '.join(live) or 'none'}")
    parts: list[RenderableType] = [pool_map_renderable(pool_map, width), block_tables_table(sequences)]
    data = {"map": pool_map.as_dict() | {"sequences": sequences}}
    if token is not None:
        address = token_address(report, request, token, sample, step)
        data["address"] = _address_dict(address)
        parts.append(address_table(address, report["pool"]["block_size"], report["pool"]["num_blocks"]))
    return data, Group(*parts)


def _address_dict(a: Any) -> dict[str, Any]:
    return {"request_id": a.request_id, "sample_index": a.sample_index, "seq_id": a.seq_id,
            "token_index": a.token_index, "logical_block": a.logical_block, "offset": a.offset,
            "physical_block": a.physical_block, "slot": a.slot, "token_bytes": a.token_bytes,
            "layers": [{"layer": l, "k_byte_offset": k, "v_byte_offset": v} for l, k, v in a.layer_offsets],
            "scales": None if a.scale_offsets is None else
            [{"layer": l, "k_scale_byte_offset": k, "v_scale_byte_offset": v}
             for l, k, v in a.scale_offsets]}
