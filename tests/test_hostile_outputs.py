"""Every file pagedgen writes, held to the run's promise when processes meet or another command
writes: one writer per output, --resume trusting nothing it reads, profile --json and the other
commands under the run's path rules, inputs that are pipes.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from jsonl_files import read_jsonl, write_jsonl
from test_hostile_run import kept, snapshot
from tiny_models import tiny_model_dir, write_tiny_run_config

GOOD = [{"id": f"g{i}", "prompt": f"x = {i}"} for i in range(3)]


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    return write_tiny_run_config(tmp_path_factory.mktemp("config") / "tiny.yaml")


def cli(*args, stdin: bytes | None = None):
    result = CliRunner().invoke(app, [*map(str, args)], input=stdin, catch_exceptions=False)
    assert "Traceback" not in result.stderr, result.stderr
    return result


# --- one writer per output ---

HOLDER = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, json.dumps({"kind": "pagedgen output lock", "pid": os.getpid(),
                          "command": ["pagedgen", "run", "held.jsonl"]}).encode(), 0)
print("locked", flush=True)
time.sleep(120)
"""


def hold_lock(lock: Path) -> subprocess.Popen:
    """Another process holding OUT.lock as a running pagedgen run does."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.parametrize("flags", [[], ["--resume"], ["--overwrite"], ["--ray"]])
def test_a_second_writer_on_one_output_is_refused_naming_the_holder(tmp_path, config_path, flags):
    inputs = write_jsonl(tmp_path / "in.jsonl", GOOD)
    holder = hold_lock(tmp_path / "in.completions.lock")
    try:
        before = snapshot(tmp_path)
        started = time.monotonic()
        result = cli("run", inputs, "-c", config_path, *flags)
        assert result.exit_code == 2, result.output
        assert time.monotonic() - started < 30     # at once, not after waiting for the holder
        assert f"pid {holder.pid}: pagedgen run held.jsonl" in result.stderr
        assert "another pagedgen process" in result.stderr
        assert snapshot(tmp_path) == before        # nothing written, nothing removed
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holder_releases_the_output(tmp_path, config_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", GOOD)
    holder = hold_lock(tmp_path / "in.completions.lock")
    os.kill(holder.pid, signal.SIGKILL)            # no handler runs: the kernel releases it
    holder.wait()
    result = cli("run", inputs, "-c", config_path, "--no-report")
    assert result.exit_code == 0, result.output
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "in.completions.jsonl")) == ["g0", "g1", "g2"]
    assert not (tmp_path / "in.completions.lock").exists()   # removed by the run that held it


def test_the_lock_is_held_while_the_run_writes(tmp_path, config_path, monkeypatch):
    """Seen from inside a running job: OUT.lock is flock'ed, by this pid."""
    import pagedgen.jobs.run_job as run_job

    inputs = write_jsonl(tmp_path / "in.jsonl", GOOD)
    lock, seen = tmp_path / "in.completions.lock", []
    real = run_job.Job.generate

    def probe(self, *args, **kwargs):
        fd = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # another open file: refused
            seen.append(json.loads(os.pread(fd, 4096, 0))["pid"])
        finally:
            os.close(fd)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(run_job.Job, "generate", probe)
    assert cli("run", inputs, "-c", config_path, "--no-report").exit_code == 0
    assert seen == [os.getpid()]


def test_a_file_in_the_lock_files_place_is_not_overwritten(tmp_path, config_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", GOOD)
    (tmp_path / "in.completions.lock").write_text("my notes\n")
    result = cli("run", inputs, "-c", config_path, "--no-report")
    assert result.exit_code == 2 and "not a pagedgen lock file" in result.stderr
    assert (tmp_path / "in.completions.lock").read_text() == "my notes\n"


# --- --resume trusts nothing it reads ---

def test_resume_keeps_the_first_of_duplicates_and_moves_foreign_records_aside(tmp_path, config_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", GOOD + [{"id": "g3", "prompt": "y"}])
    output = tmp_path / "in.completions.jsonl"
    assert cli("run", inputs, "-c", config_path, "--no-report").exit_code == 0
    records = read_jsonl(output)
    first = records[0]
    tampered = records[:2] + [dict(first, outputs=[])] \
        + [{"id": "stranger", "line": 99, "outputs": []}, {"id": "other", "line": 98, "outputs": []}]
    write_jsonl(output, tampered)              # g2, g3 missing; g0 twice; two foreign ids
    result = cli("run", inputs, "-c", config_path, "--no-report", "--resume", "--ordered")
    assert result.exit_code == 0, result.output
    assert "1 duplicate record(s)" in result.stderr
    assert f"2 record(s) whose id is not in the input moved to {tmp_path / 'in.completions.foreign.jsonl'}" \
        in result.stderr.replace("\n", "")
    ids = [r["id"] for r in read_jsonl(output)]
    assert sorted(ids) == ["g0", "g1", "g2", "g3"]                       # every id exactly once
    assert read_jsonl(output)[0] == first                                 # the first was kept
    assert [r["id"] for r in read_jsonl(tmp_path / "in.completions.foreign.jsonl")] == ["stranger", "other"]
    assert [r["id"] for r in read_jsonl(tmp_path / "in.completions.ordered.jsonl")] == ["g0", "g1", "g2", "g3"]


# --- profile --json and inputs that are pipes ---

def test_profile_json_never_replaces_its_own_workload(tmp_path, config_path):
    workload = write_jsonl(tmp_path / "wl.jsonl", GOOD)
    before = snapshot(tmp_path)
    result = cli("profile", workload, "-c", config_path, "--json", workload, "-q")
    assert result.exit_code == 2 and "same file as the workload" in result.stderr
    result = cli("profile", workload, "-c", config_path, "--json", config_path, "-q")
    assert result.exit_code == 2 and "same file as the config" in result.stderr
    (tmp_path / "notes.json").write_text('{"mine": 1}\n')
    result = cli("profile", workload, "-c", config_path, "--json", tmp_path / "notes.json", "-q")
    assert result.exit_code == 2 and "not written by pagedgen" in result.stderr
    assert kept(before, snapshot(tmp_path)) and (tmp_path / "notes.json").read_text() == '{"mine": 1}\n'


def test_profile_json_into_a_missing_folder_is_refused_before_profiling(tmp_path, config_path, monkeypatch):
    import pagedgen.cli.profile as profile

    monkeypatch.setattr(profile, "run_profile", lambda *a, **k: pytest.fail("profiled first"))
    workload = write_jsonl(tmp_path / "wl.jsonl", GOOD)
    result = cli("profile", workload, "-c", config_path, "--json", tmp_path / "nowhere" / "r.json", "-q")
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_profile_json_is_written_atomically_and_may_be_rewritten(tmp_path, config_path):
    workload = write_jsonl(tmp_path / "wl.jsonl", GOOD)
    target = tmp_path / "r.json"
    for _ in range(2):   # the second run replaces the file the first wrote
        result = cli("profile", workload, "-c", config_path, "--json", target, "-q")
        assert result.exit_code == 0, result.output
        assert json.loads(target.read_text())["kind"] == "pagedgen profile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "wl.jsonl"]


def test_profile_where_every_request_fails_says_why(tmp_path, config_path):
    result = cli("profile", "-c", config_path, "--prompt-len", "100..120", "--num-requests", "4",
                 "--max-tokens", "2..2", "-q")
    assert result.exit_code != 0
    assert "every request of the workload failed" in result.stderr
    assert "max_model_len" in result.stderr        # the first request's own reason


def test_a_fifo_is_an_input(tmp_path, config_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    lines = b"".join(json.dumps(g).encode() + b"\n" for g in GOOD)

    def feed():
        with open(fifo, "wb") as pipe:
            pipe.write(lines)
    writer = threading.Thread(target=feed)
    writer.start()
    output = tmp_path / "out.jsonl"
    result = cli("run", fifo, "-c", config_path, "--no-report", "--output", output)
    writer.join()
    assert result.exit_code == 0, result.output
    assert sorted(r["id"] for r in read_jsonl(output)) == ["g0", "g1", "g2"]
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("pagedgen-input-*"))


def test_dash_is_stdin_and_needs_an_output(tmp_path, config_path):
    lines = b"".join(json.dumps(g).encode() + b"\n" for g in GOOD)
    result = cli("run", "-", "-c", config_path, "--no-report")
    assert result.exit_code == 2 and "--output" in result.stderr
    output = tmp_path / "out.jsonl"
    result = cli("run", "-", "-c", config_path, "--no-report", "--output", output, stdin=lines)
    assert result.exit_code == 0, result.output
    assert sorted(r["id"] for r in read_jsonl(output)) == ["g0", "g1", "g2"]


def test_dev_stdin_from_a_pipe(tmp_path, config_path):
    lines = b"".join(json.dumps(g).encode() + b"\n" for g in GOOD)
    output = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "pagedgen", "run", "/dev/stdin", "-c", str(config_path),
                           "--no-report", "-q", "--output", str(output)],
                          input=lines, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert sorted(r["id"] for r in read_jsonl(output)) == ["g0", "g1", "g2"]


# --- smaller findings ---

def test_duplicate_yaml_keys_are_refused(tmp_path):
    config = tmp_path / "dup.yaml"
    config.write_text("block_size: 16\nsampling:\n  max_tokens: 3\n  max_tokens: 5\n")
    inputs = write_jsonl(tmp_path / "in.jsonl", GOOD)
    result = cli("run", inputs, "-c", config)
    assert result.exit_code == 2
    assert "key 'max_tokens' is given twice (first on line 3)" in result.stderr


def _report(tmp_path: Path, config_path: Path) -> Path:
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"id": "r", "prompt": "x", "n": 1, "max_tokens": 20}])
    assert cli("run", inputs, "-c", config_path).exit_code == 0
    return tmp_path / "in.completions.report" / "memory_report.json"


def test_inspect_memory_checks_the_report_version_and_the_sample(tmp_path, config_path):
    report = _report(tmp_path, config_path)
    ok = cli("inspect-memory", "--report", report, "--request", "r", "--json", "-")
    assert ok.exit_code == 0, ok.output
    result = cli("inspect-memory", "--report", report, "--request", "r", "--sample", "5")
    assert result.exit_code == 2 and "--sample 5: request 'r' has sample(s) 0" in result.stderr
    data = json.loads(report.read_text())
    data["version"] = 99
    report.write_text(json.dumps(data))
    result = cli("inspect-memory", "--report", report)
    assert result.exit_code == 2 and "report version 99" in result.stderr


def test_a_model_folder_without_tokenizer_files_gets_a_whole_message(tmp_path, config_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    inputs = write_jsonl(tmp_path / "in.jsonl", GOOD)
    result = cli("run", inputs, "-c", config_path, "--model", model, "--no-report")
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert "has no tokenizer files" in message and message.rstrip().endswith("as the tokenizer")
    assert not (tmp_path / "in.completions.manifest.json").exists()   # nothing written
