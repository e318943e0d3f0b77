"""The memory report as Rich tables for the terminal (reads the report dict, nothing else)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, Group
from rich.table import Table

POLICY_LABELS = {
    "static_max_model_len": "static max_model_len",
    "static_request": "static request",
    "dynamic_doubling": "doubling",
}
SAVINGS_CAPTION = ("static: max_model_len or prompt + max_tokens slots reserved per running "
                   "sequence up front; doubling: a buffer that starts at the prompt and grows x2 "
                   "when full; seqs fit: sequences of the run's average footprint that fit in the pool")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in rows:
        table.add_row(key, value)
    return table


def pool_table(pool: dict[str, Any]) -> Table:
    return _kv_table("KV pool", [
        ("block size", f"{pool['block_size']} tokens"),
        ("blocks", f"{pool['num_blocks']:,}"),
        ("bytes per token", f"{pool['bytes_per_token']:,} B"),
        ("bytes per block", human_bytes(pool["bytes_per_block"])),
        ("pool size", f"{human_bytes(pool['total_bytes'])} ({pool['total_tokens']:,} tokens)"),
        ("dtype", pool["dtype"]),
        ("KV cache dtype", _kv_cache_dtype(pool)),
    ])


def _kv_cache_dtype(pool: dict[str, Any]) -> str:
    name = pool.get("kv_cache_dtype", "auto")
    return "auto (model dtype)" if name == "auto" else f"{name} + float32 scale per block, KV head"


def peak_table(pool: dict[str, Any], s: dict[str, Any]) -> Table:
    rows = [
        ("peak step", str(s["peak_step"])),
        ("peak blocks used", f"{s['peak_blocks_used']:,} of {pool['num_blocks']:,} "
                             f"({pct(s['peak_blocks_used'] / pool['num_blocks'])})"),
        ("peak KV bytes", human_bytes(s["peak_bytes"])),
        ("KV utilization at peak", pct(s["kv_utilization_at_peak"])),
        ("KV utilization, mean over steps", pct(s["kv_utilization_mean"])),
        ("internal fragmentation at peak", f"{pct(s['internal_fragmentation_at_peak'])} "
                                           f"({s['internal_fragmentation_slots_at_peak']:,} slots)"),
    ]
    if s["shared_blocks_at_peak"]:  # sharing rows only when something was shared
        rows += [("logical / physical blocks at peak",
                  f"{s['logical_blocks_at_peak']:,} / {s['peak_blocks_used']:,}"),
                 ("shared blocks at peak", f"{s['shared_blocks_at_peak']:,}")]
    rows.append(("peak concurrent sequences", str(s["peak_concurrent_sequences"])))
    return _kv_table("Peak and utilization", rows)


def savings_table(cf: dict[str, Any]) -> Table:
    table = Table(title="What paging saved (same trace, same KV budget)", title_justify="left",
                  caption=SAVINGS_CAPTION, caption_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("allocator", no_wrap=True)
    for name in ("peak", "used", "paging saved", "%", "seqs fit"):
        table.add_column(name, justify="right", no_wrap=True)
    paging = cf["paging"]
    table.add_row("paged (this run)", human_bytes(paging["peak_bytes"]), pct(paging["used_fraction"]),
                  "-", "-", str(paging["effective_batch_capacity"]), style="bold green")
    notes = []
    for policy, label in POLICY_LABELS.items():
        p = cf[policy]
        mark = ""
        if "why_negative" in p:
            notes.append(f"{label}: paging saved less than nothing: {p['why_negative']}")
            mark = " *"
        table.add_row(label, human_bytes(p["peak_bytes"]), pct(p["used_fraction"]),
                      human_bytes(p["paging_saved_bytes"]) + mark,
                      pct(p["paging_saved_fraction"]), str(p["effective_batch_capacity"]))
    if notes:
        table.caption = SAVINGS_CAPTION + "\n" + "\n".join(f"* {n}" for n in notes)
    return table


def arena_table(arena: dict[str, Any]) -> Table:
    return _kv_table("First-fit contiguous arena of the same size (prompt + max_tokens each)", [
        ("requests placed", f"{arena['allocations']:,}"),
        ("failed: external fragmentation", f"{arena['failed_external_fragmentation']:,}"),
        ("failed: out of memory", f"{arena['failed_out_of_memory']:,}"),
        ("most holes at once", f"{arena['peak_holes']:,}"),
    ])


def events_table(s: dict[str, Any]) -> Table:
    return _kv_table("Prefix cache, copy-on-write, preemption", [
        ("prefix cache hits", f"{s['prefix_cache_hit_tokens']:,} of {s['prefix_cache_query_tokens']:,} "
                              f"prompt tokens ({pct(s['prefix_cache_hit_rate'])})"),
        ("copy-on-write block copies", f"{s['cow_copies']:,}"),
        ("preemptions", f"{s['preemptions']:,}"),
        ("tokens recomputed after preemption", f"{s['recomputed_tokens']:,}"),
        ("cached blocks evicted", f"{s['evictions']:,}"),
    ])


def sharing_table(s: dict[str, Any], cf: dict[str, Any]) -> Table:
    unshared = cf["no_sharing"]
    return _kv_table("Block sharing (prefix-cache hits, n > 1 samples, beams, tree nodes)", [
        ("shared blocks at peak", f"{s['shared_blocks_at_peak']:,}"),
        ("copy-on-write block copies", f"{s['cow_copies']:,}"),
        ("no sharing (each branch holds its whole prefix)",
         f"{unshared['peak_blocks']:,} blocks ({human_bytes(unshared['peak_bytes'])})"),
        ("paged with sharing", f"{s['peak_blocks_used']:,} blocks"),
        ("saved by sharing", f"{unshared['sharing_saved_blocks']:,} blocks "
                             f"({pct(unshared['sharing_saved_fraction'])})"),
    ])


def groups_table(section: dict[str, Any]) -> Table:
    """A hybrid pool: each layer group's pages at the peak, what its window gave back, and the
    pool had every layer kept every token."""
    rows = []
    for g in section["groups"]:
        kind = f"window {g['window']:,}" if g["window"] else "full attention"
        rows.append((f"group {g['group']} ({kind}, {g['layers']} layers, "
                     f"{g['bytes_per_token']:,} B/token)",
                     f"{g['blocks_used_at_peak']:,} blocks at peak "
                     f"({human_bytes(g['bytes_at_peak'])}), "
                     f"{g['blocks_released_by_window']:,} freed by the window"))
    full = section["full_attention"]
    rows.append(("every layer full attention", f"{human_bytes(full['peak_bytes'])} at peak "
                 f"({full['bytes_per_token']:,} B/token); this pool: "
                 f"{human_bytes(section['peak_bytes'])} "
                 f"({pct(section['peak_fraction_of_full_attention'])})"))
    return _kv_table("Layer groups (hybrid KV cache)", rows)


def weights_table(weights: dict[str, Any], pool: dict[str, Any]) -> Table:
    """What the weights hold beside the KV pool."""
    held = ("GGUF blocks as stored (packed)" if weights["held_as"] == "packed"
            else f"dense {weights['dtype']}")
    rows = [("held as", held), ("weights in memory", human_bytes(weights["total_bytes"]))]
    parts = [(key, label) for key, label in (("plain_bytes", "plain tensors"),
                                             ("repacked_bytes", "repacked for the GEMM kernels"),
                                             ("gguf_block_bytes", "GGUF blocks, mapped file"))
             if weights[key]]
    rows += [(f"  {label}", human_bytes(weights[key])) for key, label in parts]
    rows.append(("weights + KV pool", human_bytes(weights["total_bytes"] + pool["total_bytes"])))
    return _kv_table("Weights", rows)


def store_table(store: dict[str, Any]) -> Table:
    """The prefix store on disk: what it served instead of prefill, and what it took."""
    rows = [("folder", store["folder"]),
            ("prompt tokens read from the store", f"{store['hit_tokens']:,} "
                                                  f"({store['hit_blocks']:,} blocks)"),
            ("read / written", f"{human_bytes(store['bytes_read'])} / "
                               f"{human_bytes(store['bytes_written'])}"),
            ("prefill time saved (estimate)", f"{store['prefill_seconds_saved']:.1f} s")]
    if store["writes_dropped"] or store["write_stopped"]:
        rows.append(("writes dropped", f"{store['writes_dropped']:,}"
                     + (f" ({store['write_stopped']})" if store["write_stopped"] else "")))
    if store["damaged_removed"]:
        rows.append(("damaged blocks removed", f"{store['damaged_removed']:,}"))
    return _kv_table("Prefix store", rows)


def report_renderable(report: dict[str, Any]) -> Group:
    pool, summary, cf = report["pool"], report["summary"], report["counterfactual"]
    parts = [pool_table(pool), peak_table(pool, summary), savings_table(cf),
             arena_table(cf["first_fit_arena"])]
    if _any_event(summary):  # tables only for what happened
        parts.append(events_table(summary))
    if report.get("kv_groups"):
        parts.append(groups_table(report["kv_groups"]))
    if "no_sharing" in cf and cf["no_sharing"]["sharing_saved_blocks"] > 0:
        parts.append(sharing_table(summary, cf))
    if report.get("prefix_store"):
        parts.append(store_table(report["prefix_store"]))
    if report.get("weights"):
        parts.append(weights_table(report["weights"], pool))
    return Group(*parts)


def _any_event(s: dict[str, Any]) -> bool:
    return any(s[key] for key in ("prefix_cache_hit_tokens", "cow_copies", "preemptions",
                                  "recomputed_tokens", "evictions"))


def render_report(report: dict[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(report_renderable(report))
