"""Peak memory of a process and everything it spawns (vLLM runs an engine core and workers).

A thread samples /proc every `interval` seconds and sums PSS over the tree (proportional set size:
shared pages, e.g. libraries mapped by every vLLM worker, are split between processes instead of
being counted once per process as RSS would). os.wait4's ru_maxrss adds the kernel's own peak RSS
of the largest single process, which a sampler can miss between two samples.

PSS is read only when the tree's RSS (cheap: /proc/PID/status) has grown by PSS_READ_STEP
since the last read: reading smaps_rollup walks every page table of the process under its
memory-map lock, which page faults wait for. Read at every new RSS high (four times a second
while an engine faults its KV pages in) it slowed the measured run itself (pagedgen on Gemma 3
270M w64, 2 vCPUs: generate 38.5 s alone, 49 s under the sampler; bench/README.md). Between
reads, growth is counted as private, so the peak is within PSS_READ_STEP of the true one.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PSS_READ_STEP = 64 << 20


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # the process ended while we looked
        # The command name may hold spaces and parentheses: the fields start after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(root: int) -> list[int]:
    children, tree, todo = _children_map(), [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def rss_bytes(pid: int) -> int:
    """VmRSS of one process; 0 once it has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pss_bytes(pid: int) -> int:
    """PSS of one process (RSS where smaps_rollup is unavailable); 0 once it has exited."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        key = "Pss:"
    except OSError:
        try:
            text = Path(f"/proc/{pid}/status").read_text()
            key = "VmRSS:"
        except OSError:
            return 0
    for line in text.splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


class TreeMemorySampler:
    """Samples the tree's total PSS until stopped; `peak_bytes` is the largest sum seen."""

    def __init__(self, root: int, interval: float = 0.25) -> None:
        self.root, self.interval, self.peak_bytes = root, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        pss_at = rss_at = 0      # the last PSS read and the tree's RSS when it was read
        while not self._stop.wait(self.interval):
            tree = process_tree(self.root)
            rss = sum(rss_bytes(pid) for pid in tree)
            if rss >= rss_at + PSS_READ_STEP or (rss > rss_at and pss_at == 0):
                pss_at, rss_at = sum(pss_bytes(pid) for pid in tree), rss
            # Growth since the last read counted as private (PSS grows with it one for one):
            # exact for the anonymous memory an engine touches, e.g. KV pages faulted in.
            self.peak_bytes = max(self.peak_bytes, pss_at + max(0, rss - rss_at))


def wait_with_rusage(pid: int, timeout_s: float) -> tuple[int, int] | None:
    """Reap `pid` within `timeout_s`: (exit code, peak RSS bytes of its largest process, counting
    the children it reaped), or None on timeout (the process is left running)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024
        time.sleep(0.2)
    return None
