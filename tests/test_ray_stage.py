"""`pagedgen run --ray` and the Ray Data stage on a local Ray instance (2 CPUs, 2 replicas).

One Ray instance serves the module's tests in a process (starting one takes seconds; with
`-n 2`, each xdist worker that gets some of these tests starts its own). The reference for
every check is the single-process `pagedgen run` on the same input: greedy float32, so the
tokens must match.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pagedgen.cli.app import app
from tiny_models import tiny_model_dir, tiny_tokenizer
from jsonl_files import read_jsonl, write_jsonl

ray = pytest.importorskip("ray", reason="Ray Data is an optional extra: pip install 'pagedgen[ray]'")

COUNT = 40


@pytest.fixture(scope="module")
def ray_instance():
    # The replicas are Ray workers: they need the same environment as this process.
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    path.write_text(f"model: {tiny_model_dir('llama')}\ndtype: float32\ndevice: cpu\n"
                    "num_blocks: 64\nmax_num_seqs: 4\nmax_model_len: 64\nthreads: 1\n"
                    "sampling:\n  max_tokens: 8\n  temperature: 0\n  ignore_eos: true\n"
                    "ray:\n  batch_size: 3\n")
    return path


def input_lines() -> list:
    """COUNT lines of every prompt kind, four of them bad in different ways."""
    ids = tiny_tokenizer().encode("def main():")
    lines = []
    for i in range(COUNT):
        if i % 3 == 0:
            lines.append({"id": f"r{i}", "prompt": f"x = {i} +", "max_tokens": 4 + i % 7})
        elif i % 3 == 1:
            lines.append({"id": f"r{i}", "messages": [{"role": "user", "content": f"item {i}"}]})
        else:
            lines.append({"id": f"r{i}", "prompt_token_ids": ids + [i], "seed": i})
    lines[5] = b'{"id": "r5", "prompt": '                                 # invalid JSON
    lines[11] = {"id": "r11", "prompt": "a", "max_tokenz": 3}             # unknown key
    lines[17] = {"id": "r17", "prompt_token_ids": list(range(80))}        # too long (on a replica)
    lines[23] = {"id": "r3", "prompt": "again"}                           # duplicate id
    return lines


def run_cli(*args) -> object:
    return CliRunner().invoke(app, ["run", *map(str, args)], catch_exceptions=False)


def comparable(record: dict) -> dict:
    # Prefix-cache hits depend on which prompts shared a replica; the tokens may not.
    return {**record, "usage": {k: v for k, v in record.get("usage", {}).items()
                                if k != "cached_prompt_tokens"}}


def by_id(path: Path) -> dict[str, dict]:
    records = read_jsonl(path)
    keyed = {str(r["id"]): comparable(r) for r in records}
    assert len(keyed) == len(records), "an id appears twice"
    return keyed


@pytest.fixture(scope="module")
def reference(tmp_path_factory, config_path) -> dict:
    """The single-process run of the same input."""
    folder = tmp_path_factory.mktemp("single")
    inputs = write_jsonl(folder / "in.jsonl", input_lines())
    result = run_cli(inputs, "-c", config_path, "--no-report")
    assert result.exit_code == 1, result.output          # the bad lines
    output = folder / "in.completions.jsonl"
    return {"completions": by_id(output), "errors": read_jsonl(folder / "in.completions.errors.jsonl"),
            "ordered": [comparable(r) for r in read_jsonl(folder / "in.completions.ordered.jsonl")]}


def by_line(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: r["line"])


def test_ray_run_matches_the_single_process_run(tmp_path, config_path, ray_instance, reference):
    inputs = write_jsonl(tmp_path / "in.jsonl", input_lines())
    result = run_cli(inputs, "-c", config_path, "--replicas", 2)
    assert result.exit_code == 1, result.output
    assert f"{COUNT - 4} of {COUNT} requests answered, 4 failed" in " ".join(result.stderr.split())
    output = tmp_path / "in.completions.jsonl"
    assert by_id(output) == reference["completions"]
    errors = read_jsonl(tmp_path / "in.completions.errors.jsonl")
    assert by_line(errors) == by_line(reference["errors"])
    assert [r["line"] for r in by_line(errors)] == [6, 12, 18, 24]
    ordered = [comparable(r) for r in read_jsonl(tmp_path / "in.completions.ordered.jsonl")]
    assert ordered == reference["ordered"]
    # A memory report per replica, and one summary across them that adds up.
    report_dir = tmp_path / "in.completions.report"
    summary = json.loads((report_dir / "ray_summary.json").read_text())
    assert summary["rows"] == COUNT - 3                             # one bad line ran there
    per_replica = sorted((report_dir / "replicas").glob("*/memory_report.json"))
    # Ray hands batches to whichever replica is ready: on a busy machine the first may do all.
    assert 1 <= len(per_replica) == summary["replicas"] <= 2
    assert all(json.loads(p.read_text())["pool"]["num_blocks"] == 64 for p in per_replica)
    assert sum(line["rows"] for line in summary["per_replica"].values()) == COUNT - 3
    assert "Replicas (Ray)" in result.stderr


def test_a_killed_driver_is_resumed_and_every_id_appears_once(tmp_path, config_path, ray_instance,
                                                              reference):
    inputs = write_jsonl(tmp_path / "in.jsonl", input_lines())
    output = tmp_path / "in.completions.jsonl"
    command = [sys.executable, "-m", "pagedgen", "run", str(inputs), "-c", str(config_path),
               "--address", ray_instance, "--replicas", "2", "--set", "ray.batch_size=1",
               "--no-report", "-q"]
    driver = subprocess.Popen(command, stderr=subprocess.PIPE, env={**os.environ})
    deadline = time.monotonic() + 180
    while not (output.exists() and output.read_bytes().count(b"\n") >= 3):
        assert driver.poll() is None and time.monotonic() < deadline, driver.stderr.read().decode()
        time.sleep(0.02)
    driver.send_signal(signal.SIGKILL)
    driver.communicate(timeout=30)
    done_before = len(output.read_bytes().splitlines())
    assert 3 <= done_before < COUNT - 4, "the run ended before the kill"

    resumed = run_cli(inputs, "-c", config_path, "--replicas", 2, "--resume", "--no-report")
    assert resumed.exit_code == 1, resumed.output                 # the 4 bad lines
    assert by_id(output) == reference["completions"]              # every id once, same tokens
    ordered = [comparable(r) for r in read_jsonl(tmp_path / "in.completions.ordered.jsonl")]
    assert ordered == reference["ordered"]


def test_a_replica_killed_mid_run_loses_and_duplicates_nothing(tmp_path, config_path, ray_instance,
                                                               reference):
    from pagedgen.jobs.config import load_config
    from pagedgen.cli.ray_job import RayJob
    from pagedgen.jobs.run_job import resolve_paths

    lines, expected = busy_lines(reference["completions"])
    inputs = write_jsonl(tmp_path / "in.jsonl", lines)
    config = load_config(config_path, [("test", {"ray": {"enabled": True, "replicas": 2,
                                                         "batch_size": 1}})])
    paths = resolve_paths(inputs, config, write_report=True)
    job = RayJob(config, paths, Console(stderr=True), show_progress=False)
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(summary=job.run()))
    worker.start()
    deadline = time.monotonic() + 300
    while not (job.replica_reports and job.replica_reports.latest
               and paths.output.exists() and paths.output.read_bytes().count(b"\n") >= 4):
        assert worker.is_alive() and time.monotonic() < deadline, "the run ended before the kill"
        time.sleep(0.02)
    victim = _kill_a_live_replica(job, worker, deadline)
    worker.join(timeout=300)
    assert not worker.is_alive()

    summary = outcome["summary"]
    assert summary.completed == len(lines) - 4 and summary.failed == 4
    assert by_id(paths.output) == expected
    # The kill was mid-run: the victim had not done everything, and others answered the rest
    # (its restarted process re-running the batches it held, and the other replica).
    assert job.replica_reports.latest[victim]["rows"] < len(lines) - 3
    assert len(job.replica_reports.latest) >= 2


BAD_LINES = (5, 11, 17, 23)      # the indices input_lines() breaks on purpose
EXTRA_LINES = 200


def busy_lines(answers: dict) -> tuple[list, dict]:
    """input_lines() and EXTRA_LINES copies of its good lines under new ids, with the answers
    expected for all: a run long enough that a replica is surely still busy when it is killed
    (40 lines can end on a fast worker between the first answers and the kill)."""
    lines = input_lines()
    good = [i for i in range(COUNT) if i not in BAD_LINES]
    expected = dict(answers)
    for k in range(EXTRA_LINES):
        source = lines[good[k % len(good)]]
        copy = {**source, "id": f"copy{k}-{source['id']}"}
        lines.append(copy)
        expected[copy["id"]] = {**answers[source["id"]], "id": copy["id"], "line": len(lines)}
    return lines, expected


def _kill_a_live_replica(job, worker, deadline: float) -> str:
    """SIGKILL the worker process of a replica that has reported and still runs; its name.
    A reporting replica's process may already have ended (its share done): try the others,
    then wait for a new report."""
    while True:
        for name in list(job.replica_reports.latest):
            try:
                os.kill(int(name.rsplit("-", 1)[1]), signal.SIGKILL)   # the replica's worker process
                return name
            except ProcessLookupError:
                continue
        assert worker.is_alive() and time.monotonic() < deadline, "no replica left to kill"
        time.sleep(0.02)


def test_the_stage_maps_a_dataset_with_a_per_row_error_column(ray_instance):
    from pagedgen.ray_data import ProcessorConfig, build_processor

    config = ProcessorConfig(model=str(tiny_model_dir("llama")), concurrency=1, batch_size=8,
                             engine_kwargs={"dtype": "float32", "device": "cpu", "num_blocks": 64,
                                            "max_model_len": 64, "threads": 1},
                             sampling={"temperature": 0, "ignore_eos": True, "max_tokens": 3})
    processor = build_processor(config, preprocess=lambda row: {**row, "prompt": row["text"],
                                                                "sampling_params": {"max_tokens": 2}},
                                postprocess=lambda row: {"text": row["text"], "out": row["generated_text"],
                                                         "n": row["num_generated_tokens"],
                                                         "error": row["error"]})
    rows = processor(ray.data.from_items([{"text": "import os"}, {"text": ""}, {"text": "x = 1"}]))
    rows = sorted(rows.take_all(), key=lambda r: r["text"])
    assert [r["error"] for r in rows] == ["'prompt' must be a non-empty string", "", ""]
    assert [r["n"] for r in rows] == [0, 2, 2] and all(r["out"] for r in rows[1:])
