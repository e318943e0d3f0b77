"""`inspect-memory --report`: the pool map, the block tables and a token's address, for Rich.

One character per physical block, wrapped to the terminal width with the first block id of
each row in the margin. A block held by one sequence shows its request's letter in the
request's colour; shared blocks (ref > 1) are `#`, cached-free blocks `~`, free blocks blank.
Pools larger than the screen are aggregated: each cell then stands for several blocks and
shows how full they are (░ ▒ ▓ █), coloured by the request holding most of them.
"""

from __future__ import annotations

import string
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pagedgen.memory.block_map import BlockState, PoolMap, TokenAddress

SYMBOLS = string.ascii_lowercase + string.ascii_uppercase + string.digits
COLORS = ("red", "green", "yellow", "blue", "magenta", "cyan", "bright_red", "bright_green",
          "bright_yellow", "bright_blue", "bright_magenta", "bright_cyan")
SHARED, CACHED, FREE = "#", "~", " "
SHADES = " ░▒▓█"
MARGIN = 7   # "12345 │" in front of every row


@dataclass(slots=True)
class MapLayout:
    blocks_per_cell: int
    cells_per_row: int


def owner_styles(pool_map: PoolMap) -> dict[str, tuple[str, str]]:
    """request id -> (symbol, colour), in order of first appearance in the pool."""
    styles: dict[str, tuple[str, str]] = {}
    for owners in pool_map.owners:
        for owner in owners:
            if owner not in styles:
                n = len(styles)
                styles[owner] = (SYMBOLS[n % len(SYMBOLS)], COLORS[n % len(COLORS)])
    return styles


def map_layout(num_blocks: int, width: int, max_rows: int) -> MapLayout:
    cells = max(8, width - MARGIN)
    per_cell = max(1, -(-num_blocks // (cells * max_rows)))
    return MapLayout(per_cell, cells)


def _cell(pool_map: PoolMap, block: int, styles: dict[str, tuple[str, str]]) -> tuple[str, str]:
    state = pool_map.states[block]
    if state is BlockState.FREE:
        return FREE, ""
    if state is BlockState.CACHED_FREE:
        return CACHED, "dim"
    symbol, color = styles[pool_map.owners[block][0]]
    return (SHARED, f"bold {color} reverse") if state is BlockState.SHARED else (symbol, color)


def _aggregate_cell(pool_map: PoolMap, blocks: range, styles: dict[str, tuple[str, str]]) -> tuple[str, str]:
    used = [b for b in blocks if pool_map.owners[b]]
    if not used:
        cached = any(pool_map.states[b] is BlockState.CACHED_FREE for b in blocks)
        return (CACHED, "dim") if cached else (FREE, "")
    shade = SHADES[max(1, round(len(used) / len(blocks) * (len(SHADES) - 1)))]
    owner = Counter(pool_map.owners[b][0] for b in used).most_common(1)[0][0]
    return shade, styles[owner][1]


def pool_map_text(pool_map: PoolMap, width: int = 100, max_rows: int = 40) -> Text:
    layout = map_layout(len(pool_map.states), width, max_rows)
    styles = owner_styles(pool_map)
    text = Text()
    n, per_cell = len(pool_map.states), layout.blocks_per_cell
    for row_start in range(0, n, per_cell * layout.cells_per_row):
        text.append(f"{row_start:>5} │", style="dim")
        row_end = min(n, row_start + per_cell * layout.cells_per_row)
        for start in range(row_start, row_end, per_cell):
            if per_cell == 1:
                glyph, style = _cell(pool_map, start, styles)
            else:
                glyph, style = _aggregate_cell(pool_map, range(start, min(n, start + per_cell)), styles)
            text.append(glyph, style=style)
        text.append("\n")
    return text


def legend_text(pool_map: PoolMap, layout_per_cell: int) -> Text:
    styles = owner_styles(pool_map)
    text = Text()
    if layout_per_cell > 1:
        text.append(f"each cell = {layout_per_cell} blocks; shade = share in use ({SHADES[1:]}), "
                    "colour = request holding most of them\n")
    text.append(f"{SHARED} shared (ref > 1)   {CACHED} cached-free   blank = free\n", style="bold")
    if not pool_map.cached_ids_known:
        text.append(f"({pool_map.cached_free_count} cached-free blocks: ids not recorded)\n", style="dim")
    text.append("requests: ")
    for owner, (symbol, color) in styles.items():
        text.append(f"{symbol}", style=color)
        text.append(f"={owner}  ")
    return text


def counts_table(pool_map: PoolMap) -> Table:
    table = Table(title=f"Pool at step {pool_map.step}", title_justify="left")
    for name in ("blocks", "used", "shared", "cached-free", "free"):
        table.add_column(name, justify="right")
    counts = pool_map.counts()
    table.add_row(*(f"{counts[k]:,}" for k in ("num_blocks", "blocks_used", "blocks_shared",
                                                "blocks_cached_free", "blocks_free")))
    return table


def block_tables_table(sequences: list[dict[str, Any]], max_entries: int = 24) -> Table:
    table = Table(title="Block tables (physical block, (ref) when shared)", title_justify="left")
    for name, justify in (("request", "left"), ("sample", "right"), ("seq", "right"),
                          ("tokens", "right"), ("blocks", "left")):
        table.add_column(name, justify=justify)
    for seq in sequences:
        entries = [f"{b}({r})" if r > 1 else str(b)
                   for b, r in zip(seq["block_table"], seq["ref_counts"])]
        if len(entries) > max_entries:   # keep rows readable; the JSON has the full table
            entries = entries[:max_entries // 2] + ["…"] + entries[-max_entries // 2:]
        table.add_row(str(seq["request_id"]), str(seq["sample_index"]), str(seq["seq_id"]),
                      str(seq["num_tokens"]), " ".join(entries))
    return table


def address_table(addr: TokenAddress, block_size: int, num_blocks: int, max_layers: int = 4) -> Group:
    head = Text(
        f"request {addr.request_id} sample {addr.sample_index} token {addr.token_index}: "
        f"logical block {addr.token_index} // {block_size} = {addr.logical_block}, "
        f"offset {addr.token_index} % {block_size} = {addr.offset} -> physical block "
        f"{addr.physical_block}, slot {addr.slot}\n"
        f"byte offset in kv_cache[L, 2, N={num_blocks}, B={block_size}, H_kv, D] = "
        f"(((layer*2 + kv)*{num_blocks} + {addr.physical_block})*{block_size} + {addr.offset})"
        f" * {addr.token_bytes}\n(kv: 0 = K, 1 = V; {addr.token_bytes} B = H_kv x D x dtype bytes; "
        f"each of K and V spans {addr.token_bytes} contiguous bytes)")
    if addr.scale_offsets is not None:
        head.append(f"\nscales: kv_scales[L, 2, N={num_blocks}, H_kv] float32, byte offset = "
                    f"((layer*2 + kv)*{num_blocks} + {addr.physical_block}) * H_kv * 4 "
                    f"(+ 4 x kv head): one scale per block and head, shared by its {block_size} tokens")
    table = Table()
    columns = ["layer", "K byte offset", "V byte offset"]
    if addr.scale_offsets is not None:
        columns += ["K scales offset", "V scales offset"]
    for name in columns:
        table.add_column(name, justify="right")
    scales = addr.scale_offsets or [None] * len(addr.layer_offsets)
    layers = list(zip(addr.layer_offsets, scales))
    shown = layers if len(layers) <= max_layers else layers[:max_layers - 1] + [None] + layers[-1:]
    for entry in shown:
        table.add_row(*(["…"] * len(columns) if entry is None else _address_row(*entry)))
    return Group(head, table)


def _address_row(codes: tuple[int, int, int], scales: tuple[int, int, int] | None) -> list[str]:
    row = [str(codes[0]), f"{codes[1]:,}", f"{codes[2]:,}"]
    return row if scales is None else row + [f"{scales[1]:,}", f"{scales[2]:,}"]


def pool_map_renderable(pool_map: PoolMap, width: int = 100, max_rows: int = 40) -> Group:
    layout = map_layout(len(pool_map.states), width, max_rows)
    return Group(counts_table(pool_map), pool_map_text(pool_map, width, max_rows),
                 legend_text(pool_map, layout.blocks_per_cell))
