"""Hand-edited memory reports: `inspect-memory --report` names the bad field and exits 2,
before allocating anything per block."""

from __future__ import annotations

import copy
import json
import random
import tracemalloc

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.memory.inspect_report import load_report
from pagedgen.memory.report import build_report
from pagedgen.memory.report_schema import MAX_BLOCKS, validate_report
from kv_simulation import SimRequest, Simulation
from pagedgen.memory.tracker import MemoryTracker

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def report():
    rng = random.Random(3)
    requests = [SimRequest(f"r{i}", [rng.randrange(5, 900) for _ in range(rng.randint(5, 60))],
                           rng.randint(5, 30), n=rng.choice((1, 2))) for i in range(12)]
    kv = KVCacheManager(NUM_BLOCKS, 8)
    tracker = MemoryTracker(8, NUM_BLOCKS, 2 * 2 * 4 * 8 * 4, "float32", 256, num_layers=2,
                            num_kv_heads=4, head_dim=8)
    Simulation(kv, tracker, max_num_seqs=8).run(requests)
    return json.loads(json.dumps(build_report(tracker, kv.counters)))


def _peak_seq(report):
    return report["peak_block_tables"]["sequences"][0]


def _set(path_fn, value):
    def edit(report):
        container, key = path_fn(report)
        container[key] = value
    return edit


# (case name, edit of a valid report, text the error must contain)
HOSTILE = [
    ("empty pool", lambda r: r.__setitem__("pool", {}), "field pool.num_blocks is missing"),
    ("pool a list", lambda r: r.__setitem__("pool", [1, 2]), "field pool must be an object"),
    ("block size 0", _set(lambda r: (r["pool"], "block_size"), 0), "field pool.block_size must be in [1,"),
    ("block size a string", _set(lambda r: (r["pool"], "block_size"), "8"), "pool.block_size must be an integer"),
    ("num_blocks 10^10", _set(lambda r: (r["pool"], "num_blocks"), 10**10), "pool.num_blocks must be in [1,"),
    ("num_blocks true", _set(lambda r: (r["pool"], "num_blocks"), True), "pool.num_blocks must be an integer"),
    ("negative head_dim", _set(lambda r: (r["pool"]["layout"], "head_dim"), -8), "pool.layout.head_dim must be in [1,"),
    ("10^9 layers", _set(lambda r: (r["pool"]["layout"], "num_layers"), 10**9), "pool.layout.num_layers"),
    ("block id out of range", _set(lambda r: (_peak_seq(r)["block_table"], 0), NUM_BLOCKS),
     "peak_block_tables.sequences[0].block_table[0] must be in [0, 63]"),
    ("negative block id", _set(lambda r: (_peak_seq(r)["block_table"], 0), -1),
     "peak_block_tables.sequences[0].block_table[0] must be in [0, 63]"),
    ("ref_counts shorter", lambda r: _peak_seq(r)["ref_counts"].pop(), "sequences[0].ref_counts has"),
    ("tokens beyond the table", _set(lambda r: (_peak_seq(r), "num_tokens"), 10**6), "sequences[0].num_tokens"),
    ("negative step", _set(lambda r: (r["peak_block_tables"], "step"), -3), "peak_block_tables.step"),
    ("request id an object", _set(lambda r: (_peak_seq(r), "request_id"), {"a": 1}), "sequences[0].request_id"),
    ("cached block out of range", _set(lambda r: (r["peak_block_tables"], "cached_free_blocks"), [10**12]),
     "peak_block_tables.cached_free_blocks[0]"),
    ("sequences not a list", _set(lambda r: (r["peak_block_tables"], "sequences"), "x"),
     "peak_block_tables.sequences must be a list"),
    ("snapshot block id", _set(lambda r: (r["block_table_snapshots"][0]["sequences"][0]["block_table"], 0), 999),
     "block_table_snapshots[0].sequences[0].block_table[0]"),
]


def test_a_real_report_passes_unchanged(report):
    assert report["block_table_snapshots"] and report["peak_block_tables"]["sequences"]
    before = copy.deepcopy(report)
    assert validate_report(report, "r") is report and report == before


@pytest.mark.parametrize("name,edit,expected", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hand_edited_report_is_refused_naming_the_field(report, tmp_path, name, edit, expected):
    bad = copy.deepcopy(report)
    edit(bad)
    path = tmp_path / "memory_report.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError) as caught:
        load_report(path)
    assert expected in str(caught.value) and str(path) in str(caught.value)
    result = CliRunner().invoke(app, ["inspect-memory", "--report", str(path), "--json", "-"])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split()) and "Traceback" not in result.output


def test_huge_num_blocks_allocates_nothing_per_block(report, tmp_path):
    bad = copy.deepcopy(report)
    bad["pool"]["num_blocks"] = MAX_BLOCKS + 1
    path = tmp_path / "memory_report.json"
    path.write_text(json.dumps(bad))
    tracemalloc.start()
    try:
        result = CliRunner().invoke(app, ["inspect-memory", "--report", str(path)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.exit_code == 2 and "pool.num_blocks" in result.output
    assert peak < 20 * 2**20   # a per-block map would be hundreds of MB


def test_byte_offsets_of_a_valid_report_are_never_negative(report, tmp_path):
    path = tmp_path / "memory_report.json"
    path.write_text(json.dumps(report))
    seq = max(report["peak_block_tables"]["sequences"], key=lambda s: s["num_tokens"] or 0)
    result = CliRunner().invoke(app, ["inspect-memory", "--report", str(path), "--json", "-", "--request",
                                      seq["request_id"], "--sample", str(seq["sample_index"]),
                                      "--token", str(seq["num_tokens"] - 1)])
    assert result.exit_code == 0, result.output
    layers = json.loads(result.stdout)["address"]["layers"]
    assert all(l["k_byte_offset"] >= 0 and l["v_byte_offset"] >= 0 for l in layers)


def test_a_report_of_a_real_run_under_pressure_passes():
    """n > 1, prefix sharing and preemptions in a tiny pool: every recorded table is valid."""
    from pagedgen import LLM, SamplingParams
    from tiny_models import tiny_model_dir

    llm = LLM(str(tiny_model_dir()), dtype="float32", num_blocks=24, block_size=4, max_num_seqs=6)
    prompts = [list(range(5, 5 + k)) for k in (3, 9, 17, 30)]
    llm.generate(prompts, SamplingParams(n=3, temperature=0.8, max_tokens=20, ignore_eos=True, seed=1),
                 use_tqdm=False)
    assert llm.stats["preemptions"] > 0
    report = json.loads(json.dumps(llm.memory_report()))
    assert validate_report(report, "run") is report and report["block_table_snapshots"]
