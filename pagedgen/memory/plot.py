"""The memory timeline as a PNG (matplotlib, Agg backend: no display needed).

Top panel: the paged pool itself (blocks used, shared, cached-free, logical blocks, tokens
stored in block units). Bottom panel: the same run against what static and doubling allocators
would have reserved for the very same running sequences. Each panel's y-axis is scaled to its
own lines: a 20-block run in a 2,912-block pool would otherwise be a flat line at the bottom.
The pool size is drawn as a line when it falls within that range, else stated in a note.
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
HEADROOM = 1.12          # space above the highest line, so it does not touch the frame
POOL_IN_RANGE = 1.5      # the pool line is drawn when it is at most this far above the data


def _columns(report: dict[str, Any]) -> dict[str, list[float]]:
    points = report["timeline"]
    block = report["pool"]["block_size"]
    column = lambda key, scale=1: [p[key] / scale for p in points]  # noqa: E731
    return {
        "step": column("step"), "used": column("blocks_used"), "shared": column("blocks_shared"),
        "cached_free": column("blocks_cached_free"), "logical": column("logical_blocks"),
        "tokens": column("tokens_stored", block),
        "static_max": column("static_max_model_len_tokens", block),
        "static_request": column("static_request_tokens", block),
        "doubling": column("dynamic_doubling_tokens", block),
    }


def _scale_to_data(ax: plt.Axes, lines: list[list[float]], pool: dict[str, Any]) -> None:
    """y from 0 to the highest line plus headroom; the pool as a line when in range, else a note."""
    peak = max(max(line) for line in lines)
    num_blocks = pool["num_blocks"]
    top = peak
    if num_blocks <= POOL_IN_RANGE * peak:
        ax.axhline(num_blocks, color=POOL_COLOR, linestyle=":", linewidth=1.5,
                   label=f"pool size ({num_blocks:,} blocks)")
        top = max(peak, num_blocks)
    else:
        ax.text(0.99, 0.97, f"pool size {num_blocks:,} blocks ({human_bytes(pool['total_bytes'])}) "
                f"is above this scale: the highest line reaches {peak / num_blocks:.1%} of it",
                transform=ax.transAxes, ha="right", va="top", fontsize=8, color=POOL_COLOR,
                bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": POOL_COLOR, "alpha": 0.9})
    ax.set_ylim(0, max(1.0, top * HEADROOM))


def _pool_panel(ax: plt.Axes, c: dict[str, list[float]], pool: dict[str, Any]) -> None:
    used_plus_cached = [u + f for u, f in zip(c["used"], c["cached_free"])]
    ax.fill_between(c["step"], c["used"], used_plus_cached, step="post", color="#ff7f0e",
                    alpha=0.25, label="cached-free blocks (reusable prefix)")
    ax.step(c["step"], c["used"], where="post", color=PAGING_COLOR, linewidth=2, label="blocks used")
    ax.step(c["step"], c["tokens"], where="post", color="#2ca02c", linestyle="--",
            label="tokens stored / block size")
    ax.step(c["step"], c["logical"], where="post", color="#17becf", linestyle=":",
            label="logical blocks (block-table entries)")
    ax.step(c["step"], c["shared"], where="post", color="#9467bd", label="shared blocks (ref > 1)")
    _scale_to_data(ax, [used_plus_cached, c["logical"], c["tokens"], c["shared"]], pool)
    ax.set_title("Paged KV pool")
    ax.set_ylabel("blocks")


def _counterfactual_panel(ax: plt.Axes, c: dict[str, list[float]], pool: dict[str, Any]) -> None:
    max_model_len = pool["max_model_len"]
    ax.step(c["step"], c["static_max"], where="post", color="#d62728", linewidth=2,
            label=f"static: max_model_len ({max_model_len:,}) per sequence")
    ax.step(c["step"], c["static_request"], where="post", color="#e377c2",
            label="static: prompt + max_tokens per sequence")
    ax.step(c["step"], c["doubling"], where="post", color="#8c564b", linestyle="-.",
            label="dynamic: buffer doubles when full")
    ax.step(c["step"], c["used"], where="post", color=PAGING_COLOR, linewidth=2,
            label="paged: blocks used (this run)")
    _scale_to_data(ax, [c["static_max"], c["static_request"], c["doubling"], c["used"]], pool)
    ax.set_title("Reserved KV for the same running sequences")
    ax.set_ylabel("blocks (tokens / block size)")
    ax.set_xlabel("engine step")


def _bytes_axis(ax: plt.Axes, bytes_per_block: int) -> None:
    """A right-hand axis in KiB/MiB/GiB (by the axis's range), so the blocks read as memory too."""
    shown_bytes = ax.get_ylim()[1] * bytes_per_block
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                       if shown_bytes >= 2 * s or s == 1)
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


def timeline_figure(report: dict[str, Any]) -> plt.Figure:
    """The two-panel figure (the caller saves and closes it). ValueError on an empty timeline."""
    if not report.get("timeline"):
        raise ValueError("report has an empty timeline: nothing to plot")
    pool = report["pool"]
    columns = _columns(report)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8.5), sharex=True, constrained_layout=True)
    _pool_panel(top, columns, pool)
    top.axvline(report["summary"]["peak_step"], color="#7f7f7f", linestyle="--", linewidth=1,
                label=f"peak (step {report['summary']['peak_step']})")
    _counterfactual_panel(bottom, columns, pool)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.1, 1.0), fontsize=8, framealpha=0.9)
        _bytes_axis(ax, pool["bytes_per_block"])
    _ratio_note(bottom, report)
    summary = report["summary"]
    fig.suptitle(f"KV cache memory over the run — block size {pool['block_size']}, "
                 f"peak {summary['peak_blocks_used']:,} blocks, "
                 f"utilization at peak {100 * summary['kv_utilization_at_peak']:.1f}%", fontsize=13)
    return fig


def plot_timeline(report: dict[str, Any], path: str | Path) -> Path:
    """Write the PNG; returns its path. Raises ValueError on an empty timeline."""
    fig = timeline_figure(report)
    try:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
