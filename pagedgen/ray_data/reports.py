"""Replica reports -> one memory report per replica and a summary across them.

Each replica sends its cumulative report (counts, engine stats, memory report) with every
batch; the driver keeps the newest per replica. A replica that died and was restarted is a
new process with a report of its own: its work before the death is in the old one's last
report, its batches that were cut short are not (they ran again elsewhere).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from pagedgen.jobs.output_files import write_atomically
from pagedgen.memory.render import human_bytes, pct


class ReplicaReports:
    def __init__(self) -> None:
        self.latest: dict[str, dict[str, Any]] = {}

    def add(self, report_json: str) -> None:
        report = json.loads(report_json)
        known = self.latest.get(report["replica"])
        # Batches can stream back out of order: keep the report that has seen the most.
        if known is None or report["batches"] >= known["batches"]:
            self.latest[report["replica"]] = report

    def summary(self) -> dict[str, Any]:
        reports = list(self.latest.values())
        memory = [r["memory_report"]["summary"] for r in reports]
        pools = [r["memory_report"]["pool"] for r in reports]
        return {
            "replicas": len(reports),
            "rows": sum(r["rows"] for r in reports),
            "failed_rows": sum(r["failed_rows"] for r in reports),
            "batches": sum(r["batches"] for r in reports),
            "generated_tokens": sum(r["stats"]["generated_tokens"] for r in reports),
            "generate_seconds": sum(r["generate_seconds"] for r in reports),
            "load_seconds_max": max((r["load_seconds"] for r in reports), default=0.0),
            "kv_pool_bytes_total": sum(p["total_bytes"] for p in pools),
            "peak_kv_bytes_max": max((m["peak_bytes"] for m in memory), default=0),
            "peak_kv_bytes_sum": sum(m["peak_bytes"] for m in memory),
            "prefix_cache_hit_tokens": sum(m["prefix_cache_hit_tokens"] for m in memory),
            "prefix_cache_query_tokens": sum(m["prefix_cache_query_tokens"] for m in memory),
            "preemptions": sum(m["preemptions"] for m in memory),
            "per_replica": {r["replica"]: _replica_line(r) for r in reports},
        }

    def write(self, report_dir: Path, plot: bool = True) -> list[Path]:
        """REPORT_DIR/replicas/<replica>/memory_report.json (+ timeline PNG) and
        REPORT_DIR/ray_summary.json; returns the files written."""
        files = []
        for name, report in sorted(self.latest.items()):
            folder = report_dir / "replicas" / name
            files.append(_write_json(folder / "memory_report.json", report["memory_report"]))
            if plot:
                files.extend(_plot(report["memory_report"], folder / "memory_timeline.png"))
        files.append(_write_json(report_dir / "ray_summary.json", self.summary()))
        return files


def _replica_line(report: dict[str, Any]) -> dict[str, Any]:
    memory = report["memory_report"]["summary"]
    return {"rows": report["rows"], "failed_rows": report["failed_rows"],
            "batches": report["batches"], "generated_tokens": report["stats"]["generated_tokens"],
            "generate_seconds": report["generate_seconds"], "load_seconds": report["load_seconds"],
            "peak_kv_bytes": memory["peak_bytes"],
            "kv_utilization_at_peak": memory["kv_utilization_at_peak"],
            "prefix_cache_hit_rate": memory["prefix_cache_hit_rate"],
            "preemptions": memory["preemptions"]}


def _write_json(path: Path, data: Any) -> Path:
    write_atomically(path, [(json.dumps(data, indent=2) + "\n").encode()])
    return path


def _plot(memory_report: dict[str, Any], path: Path) -> list[Path]:
    from pagedgen.memory.plot import plot_timeline

    try:
        return [plot_timeline(memory_report, path)]
    except ValueError:  # nothing recorded: no timeline to draw
        return []


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title="Replicas (Ray); tok/s over generate time", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("replica", "rows", "failed", "tokens", "tok/s", "peak KV", "KV use",
                   "prefix hit", "preempt"):
        table.add_column(column, justify="left" if column == "replica" else "right")
    for name, line in summary["per_replica"].items():
        rate = line["generated_tokens"] / line["generate_seconds"] if line["generate_seconds"] else 0
        table.add_row(name, str(line["rows"]), str(line["failed_rows"]), str(line["generated_tokens"]),
                      f"{rate:.1f}", human_bytes(line["peak_kv_bytes"]),
                      pct(line["kv_utilization_at_peak"]), pct(line["prefix_cache_hit_rate"]),
                      str(line["preemptions"]))
    table.add_row("all", str(summary["rows"]), str(summary["failed_rows"]),
                  str(summary["generated_tokens"]), "", human_bytes(summary["peak_kv_bytes_sum"]),
                  "", "", str(summary["preemptions"]), style="bold")
    return table
