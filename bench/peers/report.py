"""The benchmark's output: one table of figures per engine, one of pagedgen / peer ratios."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

MIB = 2**20


@dataclass(slots=True)
class EngineRun:
    """What the driver knows about one engine's run."""

    engine: str
    status: str                       # "ok", "failed" or "skipped"
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)   # the runner's JSON line
    wall_s: float | None = None       # spawn -> exit, start-up and shutdown included
    peak_tree_bytes: int | None = None     # sampled PSS sum over the process tree
    peak_process_rss_bytes: int | None = None   # kernel's ru_maxrss of the largest process
    floor_multiple: float | None = None
    agreement: dict[str, float] | None = None
    log: str = ""

    def figure(self, name: str) -> float | None:
        value = self.result.get(name) if name in self.result else getattr(self, name, None)
        return float(value) if isinstance(value, (int, float)) else None


# (key, column title, scale, higher is better)
FIGURES = [
    ("generated_tok_s", "gen tok/s", 1, True),
    ("prompt_tok_s", "prompt tok/s", 1, True),
    ("generate_s", "generate s", 1, False),
    ("startup_s", "start-up s", 1, False),
    ("wall_s", "wall s", 1, False),
    ("peak_tree_bytes", "peak PSS MiB", MIB, False),
    ("peak_process_rss_bytes", "max RSS MiB", MIB, False),
    ("kv_allocated_bytes", "KV alloc MiB", MIB, False),
    ("kv_peak_bytes", "KV peak MiB", MIB, False),
    ("floor_multiple", "x floor", 1, False),
]


def _cell(value: float | None, scale: float = 1) -> str:
    if value is None:
        return "-"
    value /= scale
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def figures_table(runs: list[EngineRun]) -> Table:
    table = Table(title="Per engine")
    for title in ["engine", *(title for _, title, _, _ in FIGURES), "agree % (prefix/first)"]:
        table.add_column(title, justify="left" if title == "engine" else "right")
    for run in runs:
        if run.status != "ok":
            table.add_row(run.engine, f"{run.status}: {run.reason}"[:60], *["" for _ in FIGURES])
            continue
        agree = run.agreement
        agree_cell = f"{100 * agree['prefix']:.0f}/{100 * agree['first_token']:.0f}" if agree else "-"
        table.add_row(run.engine, *(_cell(run.figure(k), s) for k, _, s, _ in FIGURES), agree_cell)
    return table


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def ratios(runs: list[EngineRun], ours: str = "pagedgen") -> dict[str, dict[str, float | None]]:
    """{peer: {figure: ours / peer}} for every peer that ran, when `ours` ran."""
    mine = next((r for r in runs if r.engine == ours and r.status == "ok"), None)
    if mine is None:
        return {}
    return {run.engine: {key: ratio(mine.figure(key), run.figure(key)) for key, *_ in FIGURES}
            for run in runs if run.engine != ours and run.status == "ok"}


def ratios_table(table_ratios: dict[str, dict[str, float | None]]) -> Table:
    table = Table(title="pagedgen / peer  (tok/s: > 1 is better; time and memory: < 1 is better)")
    table.add_column("peer")
    for _, title, _, _ in FIGURES:
        table.add_column(title, justify="right")
    for peer, values in table_ratios.items():
        table.add_row(peer, *(f"{values[k]:.2f}" if values[k] is not None else "-" for k, *_ in FIGURES))
    return table


def print_report(header: list[str], runs: list[EngineRun], console: Console | None = None) -> None:
    console = console or Console(width=200)
    for line in header:
        console.print(line, highlight=False)
    console.print(figures_table(runs))
    table_ratios = ratios(runs)
    if table_ratios:
        console.print(ratios_table(table_ratios))
    for run in runs:
        for note in run.result.get("notes", []):
            console.print(f"  {run.engine}: {note}", highlight=False)


def to_json(header: dict[str, Any], runs: list[EngineRun]) -> dict[str, Any]:
    return {**header, "engines": [asdict(r) for r in runs], "ratios_pagedgen_over_peer": ratios(runs)}
