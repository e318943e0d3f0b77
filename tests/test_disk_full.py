"""Disk full at each file a run writes: ENOSPC injected at the k-th write into that file.

`os.write` is replaced for the run (every output file pagedgen writes goes through it: the
appenders and `write_atomically`). The k-th write into the named file stores half its bytes
and then fails, as a short write on a filling disk does; from then on every write anywhere
under the test folder fails (the disk is full). Then: exit 4, the message names the file and
the errno, says how many answers are safe and how to resume; no partial line, no temporary
file, no error log is left; and `--resume` on the freed disk completes exactly: the ordered
file equals a clean run's.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from jsonl_files import read_jsonl, write_jsonl
from tiny_models import tiny_model_dir

LINES = [{"id": f"r{i}", "prompt": f"value_{i} = {i}"} for i in range(5)] + [{"id": "bad", "prompt": ""}]
GOOD_IDS = sorted(f"r{i}" for i in range(5))


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    path.write_text(f"model: {tiny_model_dir('llama')}\ndtype: float32\ndevice: cpu\n"
                    "num_blocks: 64\nmax_num_seqs: 2\nmax_model_len: 64\nthreads: 1\n"
                    "enable_prefix_caching: false\n"
                    "sampling:\n  max_tokens: 4\n  temperature: 0\n  ignore_eos: true\n")
    return path


@pytest.fixture(scope="module")
def clean_ordered(tmp_path_factory, config_path) -> list[dict]:
    folder = tmp_path_factory.mktemp("clean")
    inputs = write_jsonl(folder / "in.jsonl", LINES)
    result = run(inputs, config_path, folder / "out.jsonl")
    assert result.exit_code == 1, result.output
    return read_jsonl(folder / "out.ordered.jsonl")


def run(inputs: Path, config: Path, output: Path, *flags: str):
    result = CliRunner().invoke(app, ["run", str(inputs), "-c", str(config), "--output", str(output),
                                      "--ordered", "-q", *flags], catch_exceptions=False)
    assert "Traceback" not in result.stderr, result.stderr
    return result


class FullDisk:
    """os.write that fills the disk at the k-th write into a file named `name`."""

    def __init__(self, root: Path, name: str, k: int):
        self.root, self.name, self.k = str(root), name, k
        self.count, self.full = 0, False
        self.real = os.write

    def write(self, fd: int, data) -> int:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return self.real(fd, data)
        if not path.startswith(self.root):
            return self.real(fd, data)
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if os.path.basename(path) in (self.name, self.name + ".tmp"):
            self.count += 1
            if self.count == self.k:
                self.full = True
                data = bytes(data)
                return self.real(fd, data[:max(1, len(data) // 2)])   # a short write first
        return self.real(fd, data)


# (file, k): every file a run writes, the completions file at its first and a later record.
CASES = [("out.jsonl", 1), ("out.jsonl", 3), ("out.errors.jsonl", 1), ("out.ordered.jsonl", 1),
         ("out.manifest.json", 1), ("memory_report.json", 1), ("memory_timeline.png", 1)]


@pytest.mark.parametrize("name,k", CASES)
def test_disk_full_at_each_file_then_resume_completes_exactly(tmp_path, config_path, clean_ordered,
                                                              monkeypatch, name, k):
    inputs = write_jsonl(tmp_path / "in.jsonl", LINES)
    output = tmp_path / "out.jsonl"
    disk = FullDisk(tmp_path, name, k)
    monkeypatch.setattr(os, "write", disk.write)
    failed = run(inputs, config_path, output)
    monkeypatch.undo()
    assert disk.full, f"{name} was never written {k} times"

    assert failed.exit_code == 4, failed.output
    message = " ".join(failed.stderr.split())
    target = (tmp_path / "out.report" if name.startswith("memory_") else tmp_path) / name
    assert f"cannot write {target}: No space left on device (ENOSPC)" in message
    saved = len(read_jsonl(output))
    assert f"{saved} of 6 answers are saved in {output}" in message
    assert "--resume" in message and "internal error" not in message

    # Nothing partial, nothing temporary, no error log on the full disk.
    if output.exists():
        assert output.read_bytes() == b"" or output.read_bytes().endswith(b"\n")
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert not list(tmp_path.rglob("*.error.log"))

    resumed = run(inputs, config_path, output, "--resume")
    assert resumed.exit_code == 1, resumed.output      # the bad line still fails, alone
    assert sorted(r["id"] for r in read_jsonl(output)) == GOOD_IDS   # every id exactly once
    assert read_jsonl(tmp_path / "out.ordered.jsonl") == clean_ordered


def test_disk_full_in_profile_json_is_named_and_leaves_nothing(tmp_path, config_path, monkeypatch):
    target = tmp_path / "r.json"
    disk = FullDisk(tmp_path, "r.json", 1)
    monkeypatch.setattr(os, "write", disk.write)
    result = CliRunner().invoke(app, ["profile", "-c", str(config_path), "--num-requests", "2",
                                      "--prompt-len", "4..8", "--max-tokens", "2..2", "-q",
                                      "--json", str(target)], catch_exceptions=False)
    monkeypatch.undo()
    assert result.exit_code == 4, result.output
    assert "No space left on device (ENOSPC)" in result.stderr
    assert list(tmp_path.iterdir()) == []
