"""Run one runner script as its own process and measure it from outside.

Each engine gets a fresh process so that its start-up, its wall time and its memory are its own:
nothing one engine imported or cached helps the next.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from peers.proc_tree import TreeMemorySampler, wait_with_rusage
from peers.report import EngineRun


def last_json_line(text: str) -> dict | None:
    """The runner's result: the last stdout line that is a JSON object with an "engine" key
    (engines may print their own lines before it)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict) and "engine" in value:
                return value
    return None


def _kill_group(pid: int) -> None:
    """End the runner and whatever it spawned: it runs in a process group of its own."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def launch(engine: str, command: list[str], work_dir: Path, timeout_s: float,
           env: dict[str, str] | None = None) -> EngineRun:
    """Run `command` (+ --spawn-time) and return what was measured; never raises for a failed run."""
    out_path, log_path = work_dir / f"{engine}.out", work_dir / f"{engine}.log"
    with open(out_path, "w") as out, open(log_path, "w") as log:
        spawn = time.time()
        process = subprocess.Popen([*command, "--spawn-time", repr(spawn)], stdout=out, stderr=log,
                                   env=env, start_new_session=True)
        try:
            with TreeMemorySampler(process.pid) as sampler:
                waited = wait_with_rusage(process.pid, timeout_s)
        except BaseException:  # Ctrl-C: do not leave an engine (and its workers) running
            _kill_group(process.pid)
            raise
        wall = time.time() - spawn
    if waited is None:
        _kill_group(process.pid)
        return EngineRun(engine, "failed", f"timed out after {timeout_s:.0f} s", log=str(log_path))
    code, max_rss = waited
    result = last_json_line(out_path.read_text(errors="replace"))
    if code == 0 and result is not None and "unsupported" in result:
        return EngineRun(engine, "unsupported", result["unsupported"], log=str(log_path))
    if code != 0 or result is None:
        reason = f"exit code {code}" + ("" if result else ", no result line")
        print(f"--- {engine} failed ({reason}); last lines of {log_path}:\n{_tail(log_path)}")
        return EngineRun(engine, "failed", reason, log=str(log_path))
    return EngineRun(engine, "ok", result=result, wall_s=wall, peak_tree_bytes=sampler.peak_bytes,
                     peak_process_rss_bytes=max_rss, log=str(log_path))
