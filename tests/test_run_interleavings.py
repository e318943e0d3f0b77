"""Property: whatever `run` / `--resume` processes meet on one output and however they are
killed, a last `--resume` completes it exactly.

Random schedules of up to three real processes (forked from a warm fork server, see
forked_cli.py) on one output: each a plain run or a `--resume`, started after a random delay,
sent SIGINT, SIGTERM or SIGKILL after another delay or once the output holds a given number of
records (or left to finish). While they meet, at most one
writes (the others are refused by the output lock, exit 2), so the output never holds an id
twice. Then a last `--resume` runs to completion: every id exactly once, and the ordered file
equal to a clean run's (batch-invariant mode: an answer does not depend on what shared its
batches, so a resumed run is comparable bit for bit).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import forked_cli
from pagedgen.cli.app import app
from jsonl_files import read_jsonl, write_jsonl
from tiny_models import tiny_model_dir

LINES = [{"id": f"r{i}", "prompt": f"item_{i} = {i * 7}"} for i in range(32)]
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
# A child that is killed may end by its handler (130, 143), by the signal itself before the
# handlers are installed (negative; see forked_cli.py), be refused by the lock or by an
# existing output (2), or finish (0). Never an internal error, a failed line (there are none)
# or a write error.
ALLOWED_EXITS = {0, 2, 130, 143, -signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL}

PROCESS = st.fixed_dictionaries({
    "resume": st.booleans(),
    # Seconds, drawn as milliseconds: no floats (a native library may have set flush-to-zero,
    # and hypothesis then refuses to draw floats at all).
    "start": st.integers(0, 1500).map(lambda ms: ms / 1000),
    "stop_after": st.one_of(st.none(), st.integers(100, 3000).map(lambda ms: ms / 1000)),
    # Or stopped once the output holds this many records: killed while it writes.
    "stop_at_records": st.one_of(st.none(), st.integers(1, 30)),
    "signal": st.sampled_from(SIGNALS),
})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("interleavings")
    config = folder / "tiny.yaml"
    config.write_text(f"model: {tiny_model_dir('llama')}\ndtype: float32\ndevice: cpu\n"
                      "num_blocks: 64\nmax_num_seqs: 2\nmax_model_len: 64\nthreads: 1\n"
                      "batch_invariant: true\nenable_prefix_caching: false\n"
                      "sampling:\n  max_tokens: 6\n  temperature: 0\n  ignore_eos: true\n")
    clean = folder / "clean"
    clean.mkdir()
    inputs = write_jsonl(clean / "in.jsonl", LINES)
    assert run_here(inputs, config).exit_code == 0
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(forked_cli.PRELOAD)
    yield config, read_jsonl(clean / "in.completions.ordered.jsonl"), context


def run_here(inputs: Path, config: Path, *flags: str):
    result = CliRunner().invoke(app, ["run", str(inputs), "-c", str(config), "--no-report",
                                      "--ordered", "-q", *flags], catch_exceptions=False)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def play(schedule: list[dict], inputs: Path, config: Path, context) -> list[int | None]:
    """Starts and signals the processes of `schedule` in time order; their exit codes."""
    begin, children = time.monotonic(), []
    events = sorted([(p["start"], "start", i) for i, p in enumerate(schedule)])
    for at, _, i in events:
        time.sleep(max(0.0, begin + at - time.monotonic()))
        argv = ["run", str(inputs), "-c", str(config), "--no-report", "--ordered", "-q"]
        ready = context.Event()
        child = context.Process(target=forked_cli.main,
                                args=(argv + (["--resume"] if schedule[i]["resume"] else []), ready))
        child.start()
        children.append((child, schedule[i], time.monotonic(), ready))
    deadline = time.monotonic() + 120
    output = inputs.with_name("in.completions.jsonl")
    for child, plan, started, ready in children:
        # Signals go to pagedgen, not to multiprocessing still starting the child.
        while child.is_alive() and not ready.wait(0.01) and time.monotonic() < deadline:
            pass
        if plan["stop_at_records"] is not None:
            while child.is_alive() and records(output) < plan["stop_at_records"] \
                    and time.monotonic() < deadline:
                time.sleep(0.005)
        elif plan["stop_after"] is not None:
            time.sleep(max(0.0, started + plan["stop_after"] - time.monotonic()))
        if (plan["stop_at_records"] is not None or plan["stop_after"] is not None) and child.is_alive():
            os.kill(child.pid, plan["signal"])
        child.join(max(1.0, deadline - time.monotonic()))
        if child.is_alive():      # a hang is a failure, but never leave it running
            child.kill()
            child.join()
            pytest.fail(f"a process did not end: {plan}")
    return [child.exitcode for child, _, _, _ in children]


def records(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


# No shrinking: each example costs seconds of real processes, and a failure's message already
# names its whole schedule.
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(schedule=st.lists(PROCESS, min_size=1, max_size=3))
def test_any_interleaving_then_resume_answers_every_id_once(setup, schedule):
    config, clean_ordered, context = setup
    folder = Path(tempfile.mkdtemp(prefix="pagedgen-interleave-"))
    try:
        inputs = write_jsonl(folder / "in.jsonl", LINES)
        output = folder / "in.completions.jsonl"
        exits = play(schedule, inputs, config, context)
        assert set(exits) <= ALLOWED_EXITS, (exits, schedule)
        ids = [r["id"] for r in read_jsonl(output)] if output.exists() else []
        # Complete lines only (a killed writer's partial line is cut by --resume), none twice.
        complete = ids[:-1] if output.exists() and not output.read_bytes().endswith(b"\n") else ids
        assert len(complete) == len(set(complete)), (exits, schedule)

        final = run_here(inputs, config, "--resume")
        assert final.exit_code == 0, final.output
        assert "duplicate" not in final.stderr and "not in the input" not in final.stderr
        assert sorted(r["id"] for r in read_jsonl(output)) == sorted(r["id"] for r in LINES)
        assert read_jsonl(folder / "in.completions.ordered.jsonl") == clean_ordered
        assert not list(folder.glob("*.tmp"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
