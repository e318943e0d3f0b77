"""The memory report: a plain JSON-able dict built from a MemoryTracker.

Sections: pool, summary, counterfactual, timeline, peak_block_tables, block_table_snapshots.
Ratios are fractions in [0, 1]; sizes are in bytes, tokens or blocks as their names say.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from itertools import chain
from typing import Any

from pagedgen.memory.counterfactual import POLICIES, PolicyPeak
from pagedgen.memory.tracker import MemoryTracker, SeqMemInfo, StepSample, TableSnapshot

REPORT_VERSION = 1


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def pool_section(t: MemoryTracker) -> dict[str, Any]:
    bytes_per_block = t.bytes_per_token * t.block_size
    return {
        "block_size": t.block_size, "num_blocks": t.num_blocks,
        "bytes_per_token": t.bytes_per_token, "bytes_per_block": bytes_per_block,
        "total_bytes": bytes_per_block * t.num_blocks, "total_tokens": t.num_blocks * t.block_size,
        "dtype": t.dtype, "max_model_len": t.max_model_len, "layout": t.layout,
        "kv_cache_dtype": t.kv_cache_dtype,
    }


def summary_section(t: MemoryTracker, counters: Any) -> dict[str, Any]:
    peak = t.peak or StepSample(-1, *([0] * 12))
    last = t.last or peak
    slots = peak.blocks_used * t.block_size
    return {
        "steps": t.steps_recorded, "peak_step": peak.step,
        "peak_blocks_used": peak.blocks_used,
        "peak_bytes": peak.blocks_used * t.block_size * t.bytes_per_token,
        "tokens_stored_at_peak": peak.tokens_stored,
        "kv_utilization_at_peak": _ratio(peak.tokens_stored, slots),
        "kv_utilization_mean": t.utilization.value,
        "internal_fragmentation_at_peak": _ratio(slots - peak.tokens_stored, slots),
        "internal_fragmentation_slots_at_peak": slots - peak.tokens_stored,
        "logical_blocks_at_peak": peak.logical_blocks,
        "shared_blocks_at_peak": peak.blocks_shared,
        "cached_free_blocks_at_peak": peak.blocks_cached_free,
        "running_at_peak": peak.running,
        "peak_concurrent_sequences": t.peak_running,
        "peak_concurrent_step": t.peak_running_step,
        "prefix_cache_hit_tokens": counters.prefix_hit_tokens,
        "prefix_cache_query_tokens": counters.prefix_query_tokens,
        "prefix_cache_hit_rate": _ratio(counters.prefix_hit_tokens, counters.prefix_query_tokens),
        "cow_copies": counters.cow_copies,
        "blocks_allocated": counters.blocks_allocated,
        "blocks_freed": counters.blocks_freed,
        "evictions": counters.evictions,
        "preemptions": last.preemptions,
        "recomputed_tokens": last.recomputed_tokens,
    }


def _policy_entry(t: MemoryTracker, peak: PolicyPeak, paging_bytes: int) -> dict[str, Any]:
    reserved_bytes = peak.reserved_tokens * t.token_bytes_all_layers
    return {
        "peak_bytes": reserved_bytes, "peak_step": peak.step,
        "reserved_tokens": peak.reserved_tokens, "live_tokens": peak.live_tokens,
        "used_fraction": _ratio(peak.live_tokens, peak.reserved_tokens),
        "waste_bytes": (peak.reserved_tokens - peak.live_tokens) * t.token_bytes_all_layers,
        "paging_saved_bytes": reserved_bytes - paging_bytes,
        "paging_saved_fraction": _ratio(reserved_bytes - paging_bytes, reserved_bytes),
        "effective_batch_capacity": _capacity(t, peak.total_reserved),
        **_why_negative(reserved_bytes - paging_bytes, peak, t.block_size),
    }


def _why_negative(saved_bytes: int, peak: PolicyPeak, block_size: int) -> dict[str, str]:
    """A negative saving is real, and says why: the policy reserved (nearly) exactly what was
    used, while paging rounds each sequence up to whole blocks."""
    if saved_bytes >= 0:
        return {}
    exact = peak.reserved_tokens == peak.live_tokens
    return {"why_negative": (
        ("this policy reserved exactly the tokens used (every sequence ran to its max_tokens); "
         if exact else "this policy's peak fell at another step than paging's; ")
        + f"paging rounds each sequence up to whole blocks (up to {block_size - 1} slots "
          "of its last block unused)")}


def _capacity(t: MemoryTracker, total_reserved_slots: int) -> int:
    """Sequences of the trace's average footprint under a policy that fit in the pool."""
    mean_footprint = _ratio(total_reserved_slots, t.replay.sequence_steps)
    return int(t.num_blocks * t.block_size // mean_footprint) if mean_footprint else 0


def counterfactual_section(t: MemoryTracker) -> dict[str, Any]:
    peak = t.peak or StepSample(-1, *([0] * 12))
    paging_slots = peak.blocks_used * t.block_size
    paging_bytes = paging_slots * t.bytes_per_token
    section: dict[str, Any] = {"paging": {
        "peak_bytes": paging_bytes, "peak_step": peak.step, "reserved_tokens": paging_slots,
        "live_tokens": peak.tokens_stored, "used_fraction": _ratio(peak.tokens_stored, paging_slots),
        "waste_bytes": (paging_slots - peak.tokens_stored) * t.bytes_per_token,
        "effective_batch_capacity": _capacity(t, t.paging_slot_steps),
    }}
    for policy in POLICIES:
        section[policy] = _policy_entry(t, t.replay.peaks[policy], paging_bytes)
    section["no_sharing"] = no_sharing_entry(t)
    arena = t.replay.arena
    section["first_fit_arena"] = {
        "size_tokens": arena.size, **asdict(arena.stats),
        "peak_used_bytes": arena.stats.peak_used * t.bytes_per_token,
    }
    return section


def no_sharing_entry(t: MemoryTracker) -> dict[str, Any]:
    """The same branches (n > 1 samples, beams, tree nodes) with no block shared: every block
    table entry its own block. Its peak is the most table entries at any step."""
    peak = t.peak or StepSample(-1, *([0] * 12))
    unshared = t.peak_logical or peak
    blocks, bytes_per_block = unshared.logical_blocks, t.block_size * t.bytes_per_token
    return {
        "peak_blocks": blocks, "peak_step": unshared.step,
        "peak_bytes": blocks * bytes_per_block,
        "sharing_saved_blocks": blocks - peak.blocks_used,
        "sharing_saved_fraction": _ratio(blocks - peak.blocks_used, blocks),
    }


def tables_dict(snapshot: TableSnapshot | None) -> dict[str, Any] | None:
    if snapshot is None:
        return None
    refs = Counter(chain.from_iterable(snapshot.tables.values()))
    return {"step": snapshot.step, "sample": asdict(snapshot.sample),
            "cached_free_blocks": snapshot.cached_free_blocks,
            "sequences": [_sequence_dict(seq_id, table, snapshot.running.get(seq_id), refs)
                          for seq_id, table in sorted(snapshot.tables.items())]}


def _sequence_dict(seq_id: int, table: list[int], info: SeqMemInfo | None,
                   refs: Counter[int]) -> dict[str, Any]:
    return {"seq_id": seq_id, "request_id": info.request_id if info else None,
            "sample_index": info.sample_index if info else None,
            "num_tokens": info.num_tokens if info else None,
            "block_table": table, "ref_counts": [refs[b] for b in table]}


def build_report(tracker: MemoryTracker, counters: Any) -> dict[str, Any]:
    """counters: the KV manager's KVCounters (cumulative)."""
    peak_step = tracker.peak_tables.step if tracker.peak_tables else None
    snapshots = [tables_dict(s) for s in tracker.table_snapshots.items() if s.step != peak_step]
    return {
        "version": REPORT_VERSION,
        "pool": pool_section(tracker),
        "summary": summary_section(tracker, counters),
        "counterfactual": counterfactual_section(tracker),
        "timeline_every_k_steps": tracker.timeline.stride,
        "timeline": [asdict(s) for s in tracker.timeline.items()],
        "peak_block_tables": tables_dict(tracker.peak_tables),
        "block_table_snapshots": snapshots,
        **({"kv_groups": groups_section(tracker)} if tracker.group_windows else {}),
    }


def groups_section(t: MemoryTracker) -> dict[str, Any]:
    """Per layer group of a hybrid pool: its pages at the peak and what its window gave back;
    and the pool had every layer kept every token ("every layer full attention")."""
    page_bytes = t.bytes_per_token * t.block_size
    peak = t.peak_groups or tuple(None for _ in t.group_windows)
    last = t.last_groups or peak
    groups = []
    for index, (window, layers) in enumerate(zip(t.group_windows, t.group_layers)):
        at_peak, at_end = peak[index], last[index]
        used = at_peak.blocks_used if at_peak else 0
        groups.append({
            "group": index, "window": window, "layers": layers,
            "bytes_per_token": t.bytes_per_token, "blocks_used_at_peak": used,
            "bytes_at_peak": used * page_bytes,
            "blocks_released_by_window": at_end.window_released if at_end else 0})
    pool_peak = (t.peak.blocks_used if t.peak else 0) * page_bytes
    full = t.peak_full_attention_blocks * page_bytes
    return {"groups": groups, "peak_bytes": pool_peak,
            "full_attention": {"peak_bytes": full, "peak_step": t.peak_full_attention_step,
                               "bytes_per_token": t.token_bytes_all_layers},
            "peak_fraction_of_full_attention": _ratio(pool_peak, full)}
