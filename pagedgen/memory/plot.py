"""The memory timeline as a PNG (matplotlib, Agg backend: no display needed).

Top panel: the paged pool itself (blocks used, shared, cached-free, tokens stored in block
units) with the pool's capacity always drawn. When the run touches a small part of the pool
the axis is logarithmic (symlog, so zero stays drawable): a 20-block run and a 2,912-block pool
are both readable. Bottom panel: the same running sequences under other allocators (static
max_model_len, static prompt + max_tokens, a doubling buffer, paged without sharing) against
paged; always logarithmic, since max_model_len reservations are often 100x the rest. Each
allocator's peak, as a share of the pool, is in its legend entry: no box over the lines.
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
LINEAR_UP_TO = 4.0       # a linear axis while the pool is at most this many times the data


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


def _pool_line(ax: plt.Axes, pool: dict[str, Any]) -> None:
    ax.axhline(pool["num_blocks"], color=POOL_COLOR, linestyle=":", linewidth=1.8,
               label=f"pool capacity: {pool['num_blocks']:,} blocks ({human_bytes(pool['total_bytes'])})")


def _log_scale(ax: plt.Axes, top: float) -> None:
    ax.set_yscale("symlog", linthresh=1.0, linscale=0.3)
    ax.set_ylim(0, max(2.0, top * 1.6))


def _pool_panel(ax: plt.Axes, c: dict[str, list[float]], report: dict[str, Any]) -> None:
    pool, summary = report["pool"], report["summary"]
    used_plus_cached = [u + f for u, f in zip(c["used"], c["cached_free"])]
    hits = summary.get("prefix_cache_hit_tokens", 0)
    ax.fill_between(c["step"], c["used"], used_plus_cached, step="post", color="#ff7f0e",
                    alpha=0.25, label="cached-free: freed, prefix hash kept (reused on a hit, "
                                      f"else evicted; {hits:,} prompt tokens hit)")
    ax.step(c["step"], c["used"], where="post", color=PAGING_COLOR, linewidth=2,
            label=f"blocks used (peak {summary['peak_blocks_used']:,})")
    ax.step(c["step"], c["tokens"], where="post", color="#2ca02c", linestyle="--",
            label="tokens stored / block size")
    if max(c["shared"]) > 0:
        ax.step(c["step"], c["shared"], where="post", color="#9467bd",
                label="shared blocks (ref > 1)")
    _pool_line(ax, pool)
    peak = max(max(used_plus_cached), max(c["tokens"]), 1.0)
    if pool["num_blocks"] <= LINEAR_UP_TO * peak:
        ax.set_ylim(0, max(pool["num_blocks"], peak) * HEADROOM)
    else:
        _log_scale(ax, pool["num_blocks"])
        ax.set_title("Paged KV pool (log scale: the run uses "
                     f"{summary['peak_blocks_used'] / pool['num_blocks']:.1%} of the pool at peak)")
        return
    ax.set_title("Paged KV pool")


def _share(blocks: float, pool_blocks: int) -> str:
    ratio = blocks / pool_blocks
    return f"{ratio:.2f}x pool" if ratio >= 0.1 else f"{ratio:.2%} of pool"


def _counterfactual_panel(ax: plt.Axes, c: dict[str, list[float]], report: dict[str, Any]) -> None:
    pool = report["pool"]
    n = pool["num_blocks"]
    lines = [("static_max", "#d62728", "-", 1.6,
              f"static: max_model_len ({pool['max_model_len']:,}) per sequence"),
             ("static_request", "#e377c2", "-", 1.6, "static: prompt + max_tokens per sequence"),
             ("doubling", "#8c564b", "-.", 1.4, "dynamic: buffer doubles when full")]
    if max(a - b for a, b in zip(c["logical"], c["used"])) > 0:  # only when blocks were shared
        lines.append(("logical", "#17becf", ":", 1.6, "paged without sharing (block-table entries)"))
    lines.append(("used", PAGING_COLOR, "-", 2.4, "paged: blocks used (this run)"))
    for key, color, style, width, label in lines:
        peak = max(c[key])
        ax.step(c["step"], c[key], where="post", color=color, linestyle=style, linewidth=width,
                label=f"{label}: peak {_share(peak, n)}")
    _pool_line(ax, pool)
    _log_scale(ax, max(n, *(max(c[key]) for key, *_ in lines)))
    ax.set_title("KV other allocators would reserve for the same running sequences (log scale)")
    ax.set_xlabel("engine step")


def _blocks_label(ax: plt.Axes, pool: dict[str, Any]) -> None:
    ax.set_ylabel(f"blocks (1 block = {pool['block_size']} tokens = "
                  f"{human_bytes(pool['bytes_per_block'])})")


def timeline_figure(report: dict[str, Any]) -> plt.Figure:
    """The two-panel figure (the caller saves and closes it). ValueError on an empty timeline."""
    if not report.get("timeline"):
        raise ValueError("report has an empty timeline: nothing to plot")
    pool = report["pool"]
    columns = _columns(report)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8.5), sharex=True, constrained_layout=True)
    _pool_panel(top, columns, report)
    top.axvline(report["summary"]["peak_step"], color="#7f7f7f", linestyle="--", linewidth=1,
                label=f"peak (step {report['summary']['peak_step']})")
    _counterfactual_panel(bottom, columns, report)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)
        _blocks_label(ax, pool)
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
