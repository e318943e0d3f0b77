"""MemoryTracker and the counterfactual replay, driven by a real KVCacheManager (no model).

Every figure the tracker reports is recomputed here independently from the manager and the
simulated schedule, step by step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.engine.kv_types import PoolSnapshot
from pagedgen.memory.arena import FirstFitArena
from pagedgen.memory.counterfactual import doubling_capacities, doubling_capacity, step_reservation
from pagedgen.memory.report import build_report
from pagedgen.memory.sampled_series import SampledSeries
from kv_simulation import SimRequest, Simulation
from pagedgen.memory.tracker import MemoryTracker, SeqMemInfo

B = 16
MAX_MODEL_LEN = 2048
BYTES_PER_TOKEN = 23_040   # SmolLM2-135M in bfloat16


def mixed_requests(count: int, seed: int, n_choices=(1,), prompt=(20, 600), gen=(10, 400)):
    rng = random.Random(seed)
    return [SimRequest(f"req-{i}", [rng.randrange(5, 30000) for _ in range(rng.randint(*prompt))],
                       rng.randint(*gen), n=rng.choice(n_choices)) for i in range(count)]


def new_tracker(num_blocks: int, **kwargs) -> MemoryTracker:
    return MemoryTracker(B, num_blocks, BYTES_PER_TOKEN, "bfloat16", MAX_MODEL_LEN, **kwargs)


class Observer:
    """Recomputes, after every step, what the tracker should have seen."""

    def __init__(self, sim: Simulation) -> None:
        self.sim, self.kv = sim, sim.manager
        self.peak_used, self.peak_step, self.peak_refs = -1, -1, {}
        self.utilizations, self.static_peak, self.static_live = [], 0, 0
        self.request_peak = 0
        self.steps = 0

    def after_step(self, step: int) -> None:
        self.steps += 1
        snap = self.kv.snapshot()
        tables = self.kv.block_tables()
        running = self.sim.state.running
        assert snap.tokens_stored == self.physical_tokens(tables)
        if snap.blocks_used:
            self.utilizations.append(snap.tokens_stored / (snap.blocks_used * B))
        if snap.blocks_used > self.peak_used:
            self.peak_used, self.peak_step = snap.blocks_used, step
            self.peak_refs = {b: self.kv.ref_count(b) for t in tables.values() for b in t}
        static = len(running) * MAX_MODEL_LEN
        if static > self.static_peak:
            self.static_peak = static
            self.static_live = sum(self.kv.num_tokens(s.seq_id) for s in running)
        request = sum(min(len(s.request.prompt) + s.request.max_tokens, MAX_MODEL_LEN) for s in running)
        self.request_peak = max(self.request_peak, request)

    def physical_tokens(self, tables: dict[int, list[int]]) -> int:
        fill = {}
        for seq_id, table in tables.items():
            n = self.kv.num_tokens(seq_id)
            for i, block in enumerate(table):
                fill[block] = min(B, n - i * B)
        return sum(fill.values())


def run_observed(requests, num_blocks: int, max_num_seqs: int = 64, **tracker_kwargs):
    kv = KVCacheManager(num_blocks, B)
    tracker = new_tracker(num_blocks, num_layers=30, num_kv_heads=3, head_dim=64, **tracker_kwargs)
    sim = Simulation(kv, tracker, max_num_seqs=max_num_seqs)
    sim.submit(requests)
    observer, rng, step = Observer(sim), random.Random(0), 0
    while not sim.done:
        sim.step(step, rng)
        observer.after_step(step)
        step += 1
    kv.check_integrity()
    return sim, tracker, observer


@pytest.fixture(scope="module")
def mixed_run():
    return run_observed(mixed_requests(64, seed=1), num_blocks=2400)


def test_paging_uses_its_blocks_while_static_reservation_wastes_most(mixed_run):
    sim, tracker, observer = mixed_run
    report = build_report(tracker, sim.manager.counters)
    summary, static = report["summary"], report["counterfactual"]["static_max_model_len"]
    assert sim.state.finished == 64
    assert summary["kv_utilization_at_peak"] >= 0.95
    assert static["used_fraction"] < 0.40
    assert static["peak_bytes"] == observer.static_peak * BYTES_PER_TOKEN
    assert static["live_tokens"] == observer.static_live
    assert report["counterfactual"]["static_request"]["reserved_tokens"] == observer.request_peak
    # Paging needs at most one partial block per running sequence beyond the tokens stored.
    assert summary["internal_fragmentation_slots_at_peak"] < summary["running_at_peak"] * B


def test_tracker_peak_and_means_match_an_independent_recount(mixed_run):
    sim, tracker, observer = mixed_run
    report = build_report(tracker, sim.manager.counters)
    summary = report["summary"]
    assert summary["peak_blocks_used"] == observer.peak_used
    assert summary["peak_step"] == observer.peak_step
    assert summary["kv_utilization_mean"] == pytest.approx(sum(observer.utilizations) / len(observer.utilizations))
    assert summary["peak_bytes"] == observer.peak_used * B * BYTES_PER_TOKEN
    assert summary["steps"] == observer.steps
    peak_tables = report["peak_block_tables"]
    assert peak_tables["step"] == observer.peak_step
    refs = {b: r for s in peak_tables["sequences"] for b, r in zip(s["block_table"], s["ref_counts"])}
    assert refs == observer.peak_refs
    assert len(refs) == observer.peak_used


def test_counts_agree_with_the_kv_manager_counters_with_forks_and_preemption():
    requests = mixed_requests(40, seed=7, n_choices=(1, 2, 4), prompt=(20, 300), gen=(20, 200))
    sim, tracker, _ = run_observed(requests, num_blocks=300)   # small pool: preemption
    report = build_report(tracker, sim.manager.counters)
    summary, counters = report["summary"], sim.manager.counters
    assert summary["preemptions"] == sim.state.preemptions > 0
    assert summary["recomputed_tokens"] == sim.state.recomputed_tokens > 0
    assert summary["cow_copies"] == counters.cow_copies > 0
    assert summary["prefix_cache_hit_tokens"] == counters.prefix_hit_tokens
    assert summary["prefix_cache_query_tokens"] == counters.prefix_query_tokens
    assert summary["blocks_allocated"] == counters.blocks_allocated
    assert summary["evictions"] == counters.evictions
    peak = report["peak_block_tables"]
    logical = sum(len(s["block_table"]) for s in peak["sequences"])
    shared = {b for s in peak["sequences"] for b, r in zip(s["block_table"], s["ref_counts"]) if r > 1}
    assert summary["logical_blocks_at_peak"] == logical > summary["peak_blocks_used"]
    assert summary["shared_blocks_at_peak"] == len(shared) > 0
    assert peak["sample"]["blocks_cached_free"] == len(peak["cached_free_blocks"])


def test_timeline_stays_bounded_and_keeps_the_peak():
    requests = mixed_requests(24, seed=3, prompt=(10, 100), gen=(100, 400))
    sim, tracker, observer = run_observed(requests, num_blocks=400, max_timeline_points=40,
                                          max_table_snapshots=4)
    report = build_report(tracker, sim.manager.counters)
    timeline, stride = report["timeline"], report["timeline_every_k_steps"]
    assert tracker.steps_recorded > 200 and len(timeline) <= 40 and stride > 1
    steps = [p["step"] for p in timeline]
    assert observer.peak_step in steps
    assert all(s % stride == 0 for s in steps if s != observer.peak_step)
    assert len(report["block_table_snapshots"]) <= 4
    for snap in report["block_table_snapshots"]:
        assert tracker.snapshot_at(snap["step"]) is not None


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 12), st.lists(st.booleans(), min_size=1, max_size=300))
def test_sampled_series_keeps_a_doubling_grid_and_the_pinned_item(max_items, pins):
    series: SampledSeries[int] = SampledSeries(max_items)
    for ordinal, pinned in enumerate(pins):
        series.append(ordinal, pinned=pinned)
    kept = series.items()
    last_pinned = max((i for i, p in enumerate(pins) if p), default=None)
    assert len(kept) <= max_items and kept[0] == 0 and kept == sorted(kept)
    assert last_pinned is None or last_pinned in kept
    pinned_ever = {i for i, p in enumerate(pins) if p}
    assert all(k % series.stride == 0 or k in pinned_ever for k in kept)


def test_doubling_capacity_by_hand():
    assert doubling_capacity(100, 100, 2048) == 100
    assert doubling_capacity(101, 100, 2048) == 200
    assert doubling_capacity(201, 100, 2048) == 400
    assert doubling_capacity(1500, 100, 2048) == 1600
    assert doubling_capacity(1700, 100, 2048) == 2048      # capped at max_model_len
    infos = [SeqMemInfo(0, "a", 0, 150, 100, 50), SeqMemInfo(1, "b", 0, 30, 30, 3000)]
    r = step_reservation(infos, 2048)
    assert (r.static_max_model_len, r.static_request, r.dynamic_doubling, r.live_tokens) == \
        (4096, 150 + 2048, 200 + 30, 180)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 3000)), min_size=1, max_size=20),
       st.integers(1, 4096))
def test_vectorized_doubling_matches_the_scalar_rule(seqs, max_model_len):
    tokens = np.array([n for n, _ in seqs], dtype=np.int64)
    prompts = np.array([p for _, p in seqs], dtype=np.int64)
    expected = [doubling_capacity(n, p, max_model_len) for n, p in seqs]
    assert doubling_capacities(tokens, prompts, max_model_len).tolist() == expected


def test_first_fit_arena_counts_external_fragmentation():
    arena = FirstFitArena(10)
    assert arena.allocate(1, 4) and arena.allocate(2, 2) and arena.allocate(3, 4)
    arena.release(1)
    arena.release(3)
    assert arena.free == 8
    assert not arena.allocate(4, 6)            # 8 free, but in two holes of 4
    assert not arena.allocate(5, 11)           # more than the arena
    assert arena.stats.failed_external_fragmentation == 1
    assert arena.stats.failed_out_of_memory == 1
    arena.release(2)                           # the holes merge back into one
    assert arena.allocate(6, 10) and arena.stats.peak_used == 10


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block_size"):
        MemoryTracker(0, 10, 1, "float32", 128)
    with pytest.raises(ValueError, match="bytes_per_token"):
        MemoryTracker(16, 10, 1000, "float32", 128, num_layers=3, num_kv_heads=2, head_dim=8)
    tracker = MemoryTracker(16, 10, 4, "float32", 128)
    snap = PoolSnapshot(11, 0, 11, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        tracker.record(0, snap, [], 0, 0, 0, dict, None)
