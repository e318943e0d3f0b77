"""`pagedgen run --prefix-store`: a run interrupted by Ctrl-C leaves the blocks it computed in
the store, and `--resume` reads them instead of prefilling them again, answering as a run that
was never interrupted."""

from __future__ import annotations

import json
import signal

from typer.testing import CliRunner

import pagedgen.jobs.run_job as run_job
from pagedgen.cli.app import app
from interrupts import signal_after_results
from jsonl_files import read_jsonl, write_jsonl
from tiny_models import tiny_model_dir

COUNT = 8


def run_cli(*args) -> object:
    return CliRunner().invoke(app, ["run", *map(str, args)], catch_exceptions=False)


def write_inputs(folder) -> object:
    """Prompts of several full blocks each (block size 8), none sharing a prefix."""
    return write_jsonl(folder / "in.jsonl", [
        {"id": f"r{i}", "prompt": f"def f{i}(x):\n    return x * {i} + {i * i} - len('{'ab' * i}')\n" * 3}
        for i in range(COUNT)])


def write_config(folder, store) -> object:
    path = folder / "run.yaml"
    path.write_text(f"model: {tiny_model_dir('llama')}\ndtype: float32\ndevice: cpu\n"
                    "num_blocks: 96\nblock_size: 8\nmax_num_seqs: 3\nmax_model_len: 192\n"
                    f"threads: 1\nprefix_store: {store}\n"
                    "sampling:\n  max_tokens: 6\n  temperature: 0\n  ignore_eos: true\n")
    return path


def answers(output) -> dict:
    return {r["id"]: r["outputs"] for r in read_jsonl(output)}


def test_resume_reads_the_blocks_an_interrupted_run_computed(tmp_path, monkeypatch):
    plain = tmp_path / "plain"
    plain.mkdir()
    uninterrupted = run_cli(write_inputs(plain), "-c", write_config(plain, "null"), "--no-report")
    assert uninterrupted.exit_code == 0, uninterrupted.output

    folder, store = tmp_path / "stored", tmp_path / "store"
    folder.mkdir()
    inputs, config = write_inputs(folder), write_config(folder, store)
    # A real SIGINT to this process at the first answer, while others are being prefilled.
    real_record = signal_after_results(monkeypatch, 1, signal.SIGINT)
    first = run_cli(inputs, "-c", config, "--no-report")
    assert first.exit_code == 128 + signal.SIGINT, first.output
    output = folder / "in.completions.jsonl"
    done_before = len(read_jsonl(output))
    assert 1 <= done_before < COUNT
    assert any(store.glob("blocks-v1/*/*.kvb")), "the interrupted run wrote nothing to the store"

    monkeypatch.setattr(run_job, "result_record", real_record)
    resumed = run_cli(inputs, "-c", config, "--resume")
    assert resumed.exit_code == 0, resumed.output
    report = json.loads((folder / "in.completions.report" / "memory_report.json").read_text())
    assert report["prefix_store"]["hit_tokens"] > 0            # not prefilled again
    assert answers(output) == answers(plain / "in.completions.jsonl")
