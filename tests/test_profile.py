"""`pagedgen profile`: phase timers, workloads, and a run at two block sizes on a tiny model."""

from __future__ import annotations

import json
import types

import pytest
import torch
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.cli.profile import PhaseTimer, instrument, parse_range, synthetic_workload
from pagedgen.model.runtime.timed_kernels import TimedKernels


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    from tiny_models import tiny_model_dir

    out = tmp_path_factory.mktemp("profile") / "profile.json"
    result = CliRunner().invoke(app, [
        "profile", "--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--threads", "1",
        "--num-blocks", "24", "--block-size", "8", "--block-size", "16", "--num-requests", "6",
        "--prompt-len", "5..30", "--max-tokens", "3..12", "--max-num-seqs", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    return result, json.loads(out.read_text())


def test_one_row_per_block_size_with_consistent_fields(profiled):
    result, data = profiled
    rows, workload = data["rows"], data["workload"]
    assert [r["block_size"] for r in rows] == [8, 16]
    assert [r["num_blocks"] for r in rows] == [24, 12]                 # same bytes: 24 x 8 = 12 x 16
    assert rows[0]["pool_bytes"] == rows[1]["pool_bytes"]
    for r in rows:
        assert r["requests"] == 6 and r["failed_requests"] == 0
        assert r["generated_tokens"] == workload["total_max_tokens"]     # ignore_eos: exact lengths
        assert r["prompt_tokens"] >= workload["total_prompt_tokens"]     # + recomputation, if any
        assert r["generated_tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["wall_s"])
        ms = r["step_ms"]
        parts = ms["scheduling"] + ms["attention"] + ms["forward_other"] + ms["sampling"] + ms["bookkeeping"]
        assert parts == pytest.approx(ms["step"]) and min(ms.values()) >= 0 and ms["attention"] > 0
        assert 0 < r["peak_blocks_used"] <= r["num_blocks"]
        assert r["kv_utilization_at_peak"] + r["internal_fragmentation_at_peak"] == pytest.approx(1)
        assert 1 <= r["peak_concurrent_sequences"] <= 4
    assert "B = 8" in result.stdout and "B = 16" in result.stdout and "forward: attention" in result.stdout


def test_timed_kernels_time_attention_and_pass_the_rest_through():
    calls = []
    ops = types.SimpleNamespace(paged_attention=lambda x: calls.append(x) or x * 2, copy_blocks="untouched")
    timer = PhaseTimer(torch.device("cpu"))
    timed = TimedKernels(ops, timer)
    assert timed.paged_attention(21) == 42 and calls == [21]
    assert timed.copy_blocks == "untouched"
    assert timer.totals["attention"] > 0 and timer.totals["forward"] == 0
    for _ in range(2):
        with timer.phase("step"):
            pass
    assert timer.steps == 2
    with pytest.raises(ValueError, match="unknown phase"):
        with timer.phase("lunch"):
            pass


def test_the_engine_hook_times_its_phases_and_resets_its_tracker():
    from pagedgen import LLM, SamplingParams
    from tiny_models import tiny_model_dir

    llm = LLM(str(tiny_model_dir()), dtype="float32", num_blocks=32, max_num_seqs=4, threads=1)
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert llm.tracker.steps_recorded > 0
    llm.engine.reset_tracker()
    assert llm.tracker.steps_recorded == 0 and llm.tracker.peak is None
    timer = instrument(llm)
    llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert timer.steps == llm.tracker.steps_recorded > 0
    assert all(timer.totals[name] > 0 for name in ("scheduling", "forward", "attention", "sampling"))
    llm.engine.set_phase_hook(None)
    assert llm.runner.ops is llm.runner.kernels
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert timer.steps == llm.tracker.steps_recorded - 3   # three more steps, none timed


def test_ranges_and_synthetic_workload():
    assert parse_range("32..256", "--prompt-len") == (32, 256)
    assert parse_range("7", "--max-tokens") == (7, 7)
    for bad in ("0..4", "9..3", "a..b"):
        with pytest.raises(ValueError, match="--prompt-len"):
            parse_range(bad, "--prompt-len")
    items = synthetic_workload(20, (4, 9), (2, 5), seed=3, vocab_size=50)
    assert len(items) == 20 and len({i.request_id for i in items}) == 20
    assert all(4 <= len(i.prompt_token_ids) <= 9 and 2 <= i.params.max_tokens <= 5 for i in items)
    assert all(i.params.ignore_eos and max(i.prompt_token_ids) < 50 for i in items)
    assert [i.prompt_token_ids for i in items] == [i.prompt_token_ids for i in synthetic_workload(20, (4, 9), (2, 5), 3, 50)]


def test_profile_of_a_jsonl_file_skips_bad_lines(tmp_path):
    from tiny_models import tiny_model_dir

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 3}\n'
                       '{"prompt": "def f(x): return x", "max_tokens": 2}\n'
                       '{"prompt": 12}\n')
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["profile", str(prompts), "--model", str(tiny_model_dir("llama")),
                                      "--dtype", "float32", "--threads", "1", "--num-blocks", "16",
                                      "--quiet", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["workload"]["requests"] == 2 and data["workload"]["skipped_lines"] == 1
    assert len(data["rows"]) == 1 and data["rows"][0]["block_size"] == 16
    missing = CliRunner().invoke(app, ["profile", "--prompt-len", "3..1"])
    assert missing.exit_code == 2 and "--prompt-len" in missing.output


def test_a_second_profile_with_the_same_store_reads_its_prompts_from_disk(tmp_path):
    """--prefix-store: the first profile writes the workload's full blocks, the second (a new
    process would do the same: a new engine) reads them instead of computing their prefill."""
    from tiny_models import tiny_model_dir

    store = tmp_path / "store"

    def profile(name: str) -> tuple:
        out = tmp_path / f"{name}.json"
        result = CliRunner().invoke(app, [
            "profile", "--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--threads",
            "1", "--num-blocks", "48", "--block-size", "8", "--num-requests", "4", "--prompt-len",
            "40..60", "--max-tokens", "4", "--prefix-store", str(store), "--json", str(out)])
        assert result.exit_code == 0, result.output
        return result.stdout, json.loads(out.read_text())["rows"][0]

    cold_text, cold = profile("cold")
    warm_text, warm = profile("warm")
    assert cold["prefix_store"]["hit_tokens"] == 0 and cold["prefix_store"]["bytes_written"] > 0
    # Every full block of each prompt but the one holding its last token (always computed).
    assert warm["prefix_store"]["hit_tokens"] >= 4 * 32
    assert warm["prompt_tokens"] <= cold["prompt_tokens"] - warm["prefix_store"]["hit_tokens"]
    assert warm["prefix_store"]["bytes_read"] > 0 and warm["prefix_store"]["writes_dropped"] == 0
    assert "prompt tokens read from the store" in " ".join(warm_text.split())
    assert "prompt tokens read from the store" in " ".join(cold_text.split())
