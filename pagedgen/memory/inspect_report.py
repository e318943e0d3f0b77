"""`pagedgen inspect-memory --report`: the pool map of a memory report, a request's block
table, a token's address.

The CLI parses and prints; this module decides what to compute and returns plain dicts (for
--json) next to Rich renderables (for people).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType

from pagedgen.memory.block_map import build_pool_map, recorded_tables, token_address
from pagedgen.memory.render_map import address_table, block_tables_table, pool_map_renderable
from pagedgen.memory.report_schema import validate_report


def load_report(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--report {path}: cannot read a memory report: {exc}") from None
    if not isinstance(report, dict) or "pool" not in report or "peak_block_tables" not in report:
        raise ValueError(f"--report {path}: not a pagedgen memory report (no pool / peak_block_tables)")
    return validate_report(report, f"--report {path}")


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
