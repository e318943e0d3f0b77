"""One writer per output set: an exclusive lock held by the kernel for the run's lifetime.

Two processes appending to one completions file would answer ids twice, and a `--resume`
started while the first run still writes reads a file that is still growing. So every run on
an output (plain, `--resume`, `--overwrite`, Ray) first takes `fcntl.flock(LOCK_EX | LOCK_NB)`
on OUT.lock next to it and keeps the descriptor open until it ends. The kernel releases the
lock when the process dies however it dies (SIGKILL included), so a stale lock never blocks a
later run. The file holds the holder's pid and command line, only so that a refused run can
say who holds it; the holder removes it when it ends (a killed one leaves it, harmless: the
next run locks and rewrites it).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

LOCK_KIND = "pagedgen output lock"


class OutputLocked(Exception):
    """Another process holds the lock (or the lock file is not ours): exit 2."""


class OutputLock:
    """flock on `path`; `acquire` raises OutputLocked at once instead of waiting."""

    def __init__(self, path: Path, command: list[str]):
        self.path, self.command = Path(path), command
        self._fd: int | None = None

    def acquire(self, what: str) -> None:
        while True:
            fd = self._lock_once(what)
            if _same_file(fd, self.path):
                break
            os.close(fd)   # locked a file its holder removed on release: lock the new one
        try:
            self._claim(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _lock_once(self, what: str) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)   # the output's folder, checked
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise OutputLocked(f"{what} is being written by another pagedgen process "
                               f"({holder}); only one run may write an output at a time. Wait "
                               "for it to end (or stop it), then run again") from None
        return fd

    def _claim(self, fd: int) -> None:
        content = os.pread(fd, 4096, 0)
        if content and not content.startswith(b'{"kind": "' + LOCK_KIND.encode()):
            raise OutputLocked(f"{self.path} exists and is not a pagedgen lock file; pagedgen "
                               "will not overwrite it. Move it away or choose another --output")
        holder = {"kind": LOCK_KIND, "pid": os.getpid(), "command": self.command}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        except OSError:
            pass   # a full disk: the lock holds all the same, only the holder goes unnamed

    def release(self) -> None:
        """Removes the file while still holding it, then unlocks: a run that opened the old
        file meanwhile finds it is no longer the one at the path and opens the new one."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass    # the lock still goes with the descriptor
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read_holder(fd: int) -> str:
    """'pid 1234: pagedgen run ...' from the lock file, or what is known when it is unreadable."""
    try:
        data = json.loads(os.pread(fd, 65536, 0))
        return f"pid {int(data['pid'])}: {' '.join(map(str, data.get('command', [])))}".strip()
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not recorded yet"
