"""The memory report: exact figures on a hand-made trace, rendering, the PNG, and one run
through LLM on a tiny model."""

from __future__ import annotations

import json
import random
import struct

import pytest
from rich.console import Console

from pagedgen.engine.kv_types import KVCounters, PoolSnapshot
from pagedgen.memory.plot import plot_timeline
from pagedgen.memory.render import render_report
from pagedgen.memory.report import build_report
from pagedgen.memory.tracker import MemoryTracker, SeqMemInfo

B, N, BPT, MML = 4, 10, 100, 16


def snapshot(used: int, tokens: int, cached: int = 0, shared: int = 0, logical: int | None = None):
    return PoolSnapshot(N, used, N - used, cached, shared, used if logical is None else logical, tokens)


def hand_trace() -> MemoryTracker:
    """Two sequences (prompt 5 / max 3 and prompt 2 / max 10); seq 0 finishes after step 1."""
    t = MemoryTracker(B, N, BPT, "float32", MML, num_layers=1, num_kv_heads=1, head_dim=25)
    steps = [
        (snapshot(3, 7, cached=1), [SeqMemInfo(0, "a", 0, 5, 5, 3), SeqMemInfo(1, "b", 0, 2, 2, 10)], {0: [0, 1], 1: [2]}),
        (snapshot(3, 9), [SeqMemInfo(0, "a", 0, 6, 5, 3), SeqMemInfo(1, "b", 0, 3, 2, 10)], {0: [0, 1], 1: [2]}),
        (snapshot(1, 4, cached=1), [SeqMemInfo(1, "b", 0, 4, 2, 10)], {1: [2]}),
    ]
    for step, (snap, running, tables) in enumerate(steps):
        t.record(step, snap, running, 2 - step, 0, 0, lambda tables=tables: tables, None, lambda: [0])
    return t


@pytest.fixture(scope="module")
def report():
    return build_report(hand_trace(), KVCounters(4, 2, 0, 7, 0, 0))


def test_summary_by_hand(report):
    s = report["summary"]
    assert report["pool"] | {"layout": None} == {
        "block_size": 4, "num_blocks": 10, "bytes_per_token": 100, "bytes_per_block": 400,
        "total_bytes": 4000, "total_tokens": 40, "dtype": "float32", "max_model_len": 16, "layout": None,
        "kv_cache_dtype": "auto"}
    assert report["pool"]["layout"] == {"num_layers": 1, "num_kv_heads": 1, "head_dim": 25, "dtype_bytes": 2}
    assert (s["steps"], s["peak_step"], s["peak_blocks_used"], s["peak_bytes"]) == (3, 0, 3, 1200)
    assert s["kv_utilization_at_peak"] == pytest.approx(7 / 12)
    assert s["internal_fragmentation_at_peak"] == pytest.approx(5 / 12)
    assert s["kv_utilization_mean"] == pytest.approx((7 / 12 + 9 / 12 + 4 / 4) / 3)
    assert s["prefix_cache_query_tokens"] == 7 and s["blocks_allocated"] == 4
    assert s["peak_concurrent_sequences"] == 2


def test_counterfactuals_by_hand(report):
    cf = report["counterfactual"]
    static = cf["static_max_model_len"]          # 2 x 16 slots at steps 0 and 1
    assert (static["peak_bytes"], static["peak_step"], static["live_tokens"]) == (3200, 0, 7)
    assert static["paging_saved_bytes"] == 2000 and static["paging_saved_fraction"] == pytest.approx(0.625)
    assert cf["static_request"]["reserved_tokens"] == 8 + 12
    doubling = cf["dynamic_doubling"]             # step 1: 6 tokens in 10 (5 x 2), 3 in 4 (2 x 2)
    assert (doubling["reserved_tokens"], doubling["peak_step"], doubling["live_tokens"]) == (14, 1, 9)
    # Capacity: 40 pool slots / mean footprint over the 5 (step, sequence) pairs.
    assert static["effective_batch_capacity"] == 40 // (80 / 5)
    assert cf["paging"]["effective_batch_capacity"] == int(40 // (28 / 5))
    assert cf["static_request"]["effective_batch_capacity"] == int(40 // (52 / 5))
    assert doubling["effective_batch_capacity"] == int(40 // (25 / 5))
    assert cf["first_fit_arena"]["allocations"] == 2
    assert cf["first_fit_arena"]["failed_external_fragmentation"] == 0


def test_timeline_and_tables(report):
    assert [p["step"] for p in report["timeline"]] == [0, 1, 2]
    assert [p["static_max_model_len_tokens"] for p in report["timeline"]] == [32, 32, 16]
    assert [p["waiting"] for p in report["timeline"]] == [2, 1, 0]
    peak = report["peak_block_tables"]
    assert peak["step"] == 0 and peak["cached_free_blocks"] == [0]
    assert [(s["request_id"], s["block_table"], s["ref_counts"]) for s in peak["sequences"]] == \
        [("a", [0, 1], [1, 1]), ("b", [2], [1])]
    assert json.loads(json.dumps(report)) == report


def test_terminal_summary_shows_the_figures(report):
    console = Console(record=True, width=120)
    render_report(report, console)
    text = console.export_text()
    for expected in ("KV pool", "58.3%", "static max_model_len", "3.12 KiB", "62.5%",
                     "external fragmentation"):
        assert expected in text, expected
    assert "preemptions" not in text      # tables only for what happened: nothing did here


def test_png_timeline(report, tmp_path):
    path = plot_timeline(report, tmp_path / "sub" / "timeline.png")
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width > 1000 and height > 700
    with pytest.raises(ValueError, match="empty timeline"):
        plot_timeline({**report, "timeline": []}, tmp_path / "empty.png")


def simulated_report(num_blocks: int, num_requests: int, seed: int = 1) -> dict:
    """A model-free run with SmolLM2-135M's KV geometry (bf16: 2,912 blocks of 16 in 1 GiB)."""
    from pagedgen.engine.kv_manager import KVCacheManager
    from kv_simulation import SimRequest, Simulation

    rng = random.Random(seed)
    requests = [SimRequest(f"r{i}", [rng.randrange(5, 9000) for _ in range(rng.randint(20, 60))],
                           rng.randint(10, 40), n=rng.choice((1, 2))) for i in range(num_requests)]
    kv = KVCacheManager(num_blocks, 16)
    tracker = MemoryTracker(16, num_blocks, 2 * 30 * 3 * 64 * 2, "bfloat16", 2048, num_layers=30,
                            num_kv_heads=3, head_dim=64)
    Simulation(kv, tracker, max_num_seqs=8).run(requests)
    return json.loads(json.dumps(build_report(tracker, kv.counters)))


def panel_scale(ax) -> tuple[float, float, bool, str]:
    """(y top, highest plotted value, pool line in the legend, the axes' text notes)."""
    highest = max(max(line.get_ydata()) for line in ax.get_lines() if len(line.get_xdata()) > 2)
    for area in ax.collections:   # the cached-free band reaches above the lines
        highest = max(highest, max(y for path in area.get_paths() for _, y in path.vertices))
    labels = ax.get_legend_handles_labels()[1]
    return (ax.get_ylim()[1], highest, any(label.startswith("pool capacity") for label in labels),
            " ".join(t.get_text() for t in ax.texts))


@pytest.mark.parametrize("num_blocks, num_requests, pool_in_range", [(2912, 3, False), (40, 12, True)])
def test_timeline_y_axis_follows_the_data(num_blocks, num_requests, pool_in_range, tmp_path):
    """The pool's capacity is always drawn; a small run in a big pool gets a log axis (not a
    flat line at the bottom of a pool-sized one); the counterfactual panel is always log, so
    paged and the realistic allocators stay visible under max_model_len; no note box."""
    import matplotlib.pyplot as plt

    from pagedgen.memory.plot import HEADROOM, timeline_figure

    report = simulated_report(num_blocks, num_requests)
    assert report["summary"]["peak_blocks_used"] < 0.05 * num_blocks or pool_in_range
    figure = timeline_figure(report)
    try:
        pool_panel, counterfactual_panel = figure.axes[:2]
        for ax in (pool_panel, counterfactual_panel):
            top, highest, pool_line, notes = panel_scale(ax)
            assert pool_line and top >= num_blocks and notes == ""
        top, highest, _, _ = panel_scale(pool_panel)
        if pool_in_range:
            assert pool_panel.get_yscale() == "linear"
            assert top == pytest.approx(max(highest, num_blocks) * HEADROOM)
        else:
            assert pool_panel.get_yscale() == "symlog"
        assert counterfactual_panel.get_yscale() == "symlog"
        labels = counterfactual_panel.get_legend_handles_labels()[1]
        assert any(label.startswith("paged: blocks used") and "pool" in label for label in labels)
    finally:
        plt.close(figure)
    assert plot_timeline(report, tmp_path / f"pool{num_blocks}.png").stat().st_size > 10_000


def test_report_through_llm_on_a_tiny_model(tmp_path):
    from tiny_models import tiny_model_dir

    from pagedgen import LLM, SamplingParams

    # 16 blocks of 4 tokens: too few for all five requests at once, so the scheduler preempts.
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", block_size=4, num_blocks=16,
              max_num_seqs=8, threads=1)
    prompts = [list(range(10 + 3 * i, 10 + 3 * i + 9 + 4 * i)) for i in range(5)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True, n=1 + (i % 2))
              for i in range(5)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    report = llm.memory_report()
    s, kv, stats = report["summary"], llm.engine.kv, llm.stats
    assert all(o.error is None for o in outputs)
    assert s["steps"] == stats["steps"]
    assert s["preemptions"] == stats["preemptions"] > 0
    assert s["recomputed_tokens"] == stats["recomputed_tokens"] > 0
    assert s["cow_copies"] == kv.counters.cow_copies > 0            # n = 2 forks share a partial block
    assert s["prefix_cache_query_tokens"] == kv.counters.prefix_query_tokens
    assert 0 < s["kv_utilization_at_peak"] <= 1 and s["peak_blocks_used"] <= 16
    assert report["timeline"][-1]["blocks_used"] == 0                 # everything freed at the end
    peak = report["peak_block_tables"]
    assert sum(len(q["block_table"]) for q in peak["sequences"]) == s["logical_blocks_at_peak"]
    for seq in peak["sequences"]:
        assert seq["request_id"] in {o.request_id for o in outputs}
        assert len(seq["block_table"]) == -(-seq["num_tokens"] // 4)
    assert report["pool"]["layout"]["num_layers"] == 2
    assert plot_timeline(report, tmp_path / "t.png").stat().st_size > 10_000


def test_paging_keeps_utilization_high_where_static_reservation_wastes_it():
    """The report's headline figure through the real engine: 64 mixed-length requests, B = 16,
    max_model_len 2,048. Paging fills >= 95% of the slots it allocated at the peak, while a
    static allocator reserving max_model_len per running sequence would use < 40% of its own."""
    from tiny_models import tiny_model_dir

    from pagedgen import LLM, SamplingParams

    rng = random.Random(5)
    llm = LLM(str(tiny_model_dir("llama", max_position_embeddings=2048)), dtype="float32",
              block_size=16, num_blocks=4096, max_model_len=2048, max_num_seqs=64,
              max_num_batched_tokens=8192, threads=1)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(200, 700))] for _ in range(64)]
    params = [SamplingParams(max_tokens=rng.randint(4, 24), temperature=0, ignore_eos=True)
              for _ in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outputs)
    report = llm.memory_report()
    summary, static = report["summary"], report["counterfactual"]["static_max_model_len"]
    assert summary["peak_concurrent_sequences"] >= 48   # nearly all 64 run at once
    assert summary["kv_utilization_at_peak"] >= 0.95
    assert static["used_fraction"] < 0.40
    # The same figures from the manager's own view at the end: everything freed, counts agree.
    assert summary["blocks_allocated"] == llm.engine.kv.counters.blocks_allocated
    assert llm.engine.kv.snapshot().blocks_used == 0
