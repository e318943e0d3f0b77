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


def _preemptions(run: EngineRun) -> str:
    value = run.result.get("preemptions")
    return "n/a" if value is None else str(value)


def figures_table(runs: list[EngineRun], title: str = "Per engine") -> Table:
    table = Table(title=title)
    for column in ["engine", *(t for _, t, _, _ in FIGURES), "preempt", "agree % (prefix/first)"]:
        table.add_column(column, justify="left" if column == "engine" else "right")
    for run in runs:
        if run.status != "ok":
            table.add_row(run.engine, f"{run.status}: {run.reason}"[:60], *["" for _ in FIGURES], "")
            continue
        agree = run.agreement
        agree_cell = f"{100 * agree['prefix']:.0f}/{100 * agree['first_token']:.0f}" if agree else "-"
        table.add_row(run.engine, *(_cell(run.figure(k), s) for k, _, s, _ in FIGURES),
                      _preemptions(run), agree_cell)
    return table


# The suite's summary: the columns, one row per workload and engine.
SUITE_FIGURES = ["generated_tok_s", "prompt_tok_s", "wall_s", "startup_s", "peak_tree_bytes",
                 "kv_peak_bytes", "floor_multiple"]
SUITE_RATIOS = ["generated_tok_s", "prompt_tok_s", "wall_s", "startup_s", "peak_tree_bytes"]


def _figure(key: str) -> tuple[str, float]:
    return next((title, scale) for k, title, scale, _ in FIGURES if k == key)


def suite_table(suite: list[tuple[str, list[EngineRun]]]) -> Table:
    table = Table(title="Suite: workload x engine")
    for column in ["workload", "engine", *(_figure(k)[0] for k in SUITE_FIGURES), "preempt"]:
        table.add_column(column, justify="left" if column in ("workload", "engine") else "right")
    for workload, runs in suite:
        for run in runs:
            if run.status != "ok":
                cells = [f"{run.status}: {run.reason}"[:60], *["" for _ in SUITE_FIGURES[1:]], ""]
            else:
                cells = [*(_cell(run.figure(k), _figure(k)[1]) for k in SUITE_FIGURES), _preemptions(run)]
            table.add_row(workload, run.engine, *cells)
    return table


def suite_ratios_table(suite: list[tuple[str, list[EngineRun]]]) -> Table:
    table = Table(title="Suite: pagedgen / peer  (tok/s: > 1 is better; time and memory: < 1 is better)")
    for column in ["workload", "peer", *(_figure(k)[0] for k in SUITE_RATIOS)]:
        table.add_column(column, justify="left" if column in ("workload", "peer") else "right")
    for workload, runs in suite:
        for peer, values in ratios(runs).items():
            table.add_row(workload, peer, *(f"{values[k]:.2f}" if values[k] is not None else "-"
                                            for k in SUITE_RATIOS))
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


def print_report(header: list[str], runs: list[EngineRun], console: Console | None = None,
                 title: str = "Per engine") -> None:
    console = console or Console(width=200)
    for line in header:
        console.print(line, highlight=False)
    console.print(figures_table(runs, title))
    table_ratios = ratios(runs)
    if table_ratios:
        console.print(ratios_table(table_ratios))
    for run in runs:
        for note in run.result.get("notes", []):
            console.print(f"  {run.engine}: {note}", highlight=False)


def print_suite(suite: list[tuple[str, list[EngineRun]]], console: Console | None = None) -> None:
    console = console or Console(width=200)
    console.print(suite_table(suite))
    if any(ratios(runs) for _, runs in suite):
        console.print(suite_ratios_table(suite))


def to_json(header: dict[str, Any], runs: list[EngineRun]) -> dict[str, Any]:
    return {**header, "engines": [asdict(r) for r in runs], "ratios_pagedgen_over_peer": ratios(runs)}
