"""The memory timeline as a PNG (matplotlib, Agg backend: no display needed).

Top panel: the paged pool itself (blocks used, shared, cached-free, tokens stored in block
units, pool size). Bottom panel: the same run against what static and doubling allocators
would have reserved for the very same running sequences, with the pool size for contrast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from pagedgen.memory.render import human_bytes  # noqa: E402

PAGING_COLOR = "#1f77b4"
POOL_COLOR = "#444444"


def _columns(report: dict[str, Any]) -> dict[str, list[float]]:
    points = report["timeline"]
    block = report["pool"]["block_size"]
    column = lambda key, scale=1: [p[key] / scale for p in points]  # noqa: E731
    return {
        "step": column("step"), "used": column("blocks_used"), "shared": column("blocks_shared"),
        "cached_free": column("blocks_cached_free"), "tokens": column("tokens_stored", block),
        "static_max": column("static_max_model_len_tokens", block),
        "static_request": column("static_request_tokens", block),
        "doubling": column("dynamic_doubling_tokens", block),
    }


def _pool_line(ax: plt.Axes, num_blocks: int) -> None:
    ax.axhline(num_blocks, color=POOL_COLOR, linestyle=":", linewidth=1.5,
               label=f"pool size ({num_blocks:,} blocks)")


def _pool_panel(ax: plt.Axes, c: dict[str, list[float]], num_blocks: int) -> None:
    used_plus_cached = [u + f for u, f in zip(c["used"], c["cached_free"])]
    ax.fill_between(c["step"], c["used"], used_plus_cached, step="post", color="#ff7f0e",
                    alpha=0.25, label="cached-free blocks (reusable prefix)")
    ax.step(c["step"], c["used"], where="post", color=PAGING_COLOR, linewidth=2, label="blocks used")
    ax.step(c["step"], c["tokens"], where="post", color="#2ca02c", linestyle="--",
            label="tokens stored / block size")
    ax.step(c["step"], c["shared"], where="post", color="#9467bd", label="shared blocks (ref > 1)")
    _pool_line(ax, num_blocks)
    ax.set_title("Paged KV pool")
    ax.set_ylabel("blocks")


def _counterfactual_panel(ax: plt.Axes, c: dict[str, list[float]], num_blocks: int,
                          max_model_len: int) -> None:
    ax.step(c["step"], c["static_max"], where="post", color="#d62728", linewidth=2,
            label=f"static: max_model_len ({max_model_len:,}) per sequence")
    ax.step(c["step"], c["static_request"], where="post", color="#e377c2",
            label="static: prompt + max_tokens per sequence")
    ax.step(c["step"], c["doubling"], where="post", color="#8c564b", linestyle="-.",
            label="dynamic: buffer doubles when full")
    ax.step(c["step"], c["used"], where="post", color=PAGING_COLOR, linewidth=2,
            label="paged: blocks used (this run)")
    _pool_line(ax, num_blocks)
    ax.set_title("Reserved KV for the same running sequences")
    ax.set_ylabel("blocks (tokens / block size)")
    ax.set_xlabel("engine step")


def _bytes_axis(ax: plt.Axes, bytes_per_block: int, pool_bytes: int) -> None:
    """A right-hand axis in KiB/MiB/GiB (by the pool's size), so the blocks read as memory too."""
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                       if pool_bytes >= 2 * s or s == 1)
    factor = bytes_per_block / scale
    axis = ax.secondary_yaxis("right", functions=(lambda b: b * factor, lambda m: m / factor))
    axis.set_ylabel(unit)


def _ratio_note(ax: plt.Axes, report: dict[str, Any]) -> None:
    cf, pool_bytes = report["counterfactual"], report["pool"]["total_bytes"]
    lines = [f"peak reserved / pool size ({human_bytes(pool_bytes)}):"]
    for key, label in (("static_max_model_len", "static max_model_len"),
                       ("static_request", "static prompt+max_tokens"),
                       ("dynamic_doubling", "dynamic doubling"), ("paging", "paged")):
        lines.append(f"  {label}: {cf[key]['peak_bytes'] / pool_bytes:.2f}x")
    ax.text(1.1, 0.68, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=8,
            family="monospace", bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85})


def plot_timeline(report: dict[str, Any], path: str | Path) -> Path:
    """Write the PNG; returns its path. Raises ValueError on an empty timeline."""
    if not report.get("timeline"):
        raise ValueError("report has an empty timeline: nothing to plot")
    pool = report["pool"]
    columns = _columns(report)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8.5), sharex=True, constrained_layout=True)
    _pool_panel(top, columns, pool["num_blocks"])
    top.axvline(report["summary"]["peak_step"], color="#7f7f7f", linestyle="--", linewidth=1,
                label=f"peak (step {report['summary']['peak_step']})")
    _counterfactual_panel(bottom, columns, pool["num_blocks"], pool["max_model_len"])
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", bbox_to_anchor=(1.1, 1.0), fontsize=8, framealpha=0.9)
        _bytes_axis(ax, pool["bytes_per_block"], pool["total_bytes"])
    _ratio_note(bottom, report)
    summary = report["summary"]
    fig.suptitle(f"KV cache memory over the run — block size {pool['block_size']}, "
                 f"peak {summary['peak_blocks_used']:,} blocks, "
                 f"utilization at peak {100 * summary['kv_utilization_at_peak']:.1f}%", fontsize=13)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
