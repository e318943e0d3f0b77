"""Where a run reads and writes, checked before anything runs (a problem here is exit 2).

Every file the run may write is named up front (`JobPaths.targets`). Before the model loads:
- no two of them, nor any of them and the input, are the same file after resolving links
  (symbolic or hard): `--errors A.jsonl` for input `A.jsonl` would replace the input;
- each is of the right kind (a folder where a file is meant is refused) and can be written:
  an existing file is opened for appending (not changed), a new one's nearest existing folder
  gets a probe file created and removed;
- an existing, non-empty file that the run manifest does not list as written by pagedgen is
  never touched: the run is refused instead (see manifest.py).
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pagedgen.jobs.config import RunConfig


class UsageError(Exception):
    """Found before anything ran (bad paths, an output that would be clobbered): exit 2."""


REPORT_FILES = ("memory_report.json", "memory_timeline.png")


def sibling(path: Path, suffix: str) -> Path:
    """out.jsonl -> out{suffix} in the same folder, e.g. '.errors.jsonl', '.report'."""
    stem = path.name.removesuffix(".jsonl")
    return path.with_name(stem + suffix)


def temporary_name(path: Path) -> Path:
    """The name `write_atomically` writes before renaming onto `path`."""
    return path.with_name(path.name + ".tmp")


def default_output_path(input_path: Path) -> Path:
    """prompts.jsonl -> prompts.completions.jsonl, next to the input."""
    return sibling(input_path, ".completions.jsonl")


@dataclass(slots=True)
class JobPaths:
    input: Path
    output: Path
    errors: Path
    ordered: Path | None        # None: not wanted
    report_dir: Path | None     # None: no memory report

    @property
    def manifest(self) -> Path:
        return sibling(self.output, ".manifest.json")

    @property
    def lock(self) -> Path:
        """Held (flock) by the one process writing this output set (output_lock.py)."""
        return sibling(self.output, ".lock")

    @property
    def foreign(self) -> Path:
        """Where --resume moves records whose id is not in the input."""
        return sibling(self.output, ".foreign.jsonl")

    @property
    def error_log(self) -> Path:
        """Where the traceback of an internal error goes."""
        return sibling(self.output, ".error.log")

    def report_files(self) -> list[Path]:
        return [] if self.report_dir is None else [self.report_dir / name for name in REPORT_FILES]

    def targets(self) -> list[tuple[str, Path]]:
        """(what, path) of every file this run may create, append to or replace."""
        named = [("output", self.output), ("errors file", self.errors),
                 ("ordered file", self.ordered), ("run manifest", self.manifest),
                 ("error log", self.error_log), ("lock file", self.lock),
                 ("file of foreign records", self.foreign)]
        named += [("report file", f) for f in self.report_files()]
        named = [(what, p) for what, p in named if p is not None]
        # Written to a temporary name first, then renamed over the target.
        whole = {self.ordered, self.manifest, self.output, self.foreign, *self.report_files()}
        return named + [(f"temporary {what}", temporary_name(p)) for what, p in named if p in whole]


def is_stream(path: Path) -> bool:
    """'-' (stdin), /dev/stdin, a FIFO: an input that can be read once only."""
    if str(path) == "-":
        return True
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode)


def spool_stream(path: Path) -> Path:
    """Copies a stream input to a private temporary file, read once: the run reads its input
    more than once (digest, lines, Ray rows). The caller deletes the copy."""
    handle, name = tempfile.mkstemp(prefix="pagedgen-input-", suffix=".jsonl")
    try:
        with os.fdopen(handle, "wb") as copy:
            if str(path) == "-":
                _copy(sys.stdin.buffer, copy)
            else:
                with open(path, "rb") as source:
                    _copy(source, copy)
    except OSError as exc:
        os.unlink(name)
        raise UsageError(f"{path}: cannot read the input: {exc.strerror or exc}") from None
    return Path(name)


def _copy(source: BinaryIO, target: BinaryIO) -> None:
    while chunk := source.read(1 << 20):
        target.write(chunk)


def resolve_paths(input_path: str | Path, config: RunConfig, write_report: bool = True) -> JobPaths:
    out = config.output
    if not out.path and is_stream(Path(input_path)):
        raise UsageError(f"the input {input_path} is a pipe or stdin: name the completions file "
                         "with --output (there is no folder to put it next to)")
    output = Path(out.path) if out.path else default_output_path(Path(input_path))
    return JobPaths(
        input=Path(input_path), output=output,
        errors=Path(out.errors_path) if out.errors_path else sibling(output, ".errors.jsonl"),
        ordered=sibling(output, ".ordered.jsonl") if out.ordered else None,
        report_dir=(Path(out.report_dir) if out.report_dir else sibling(output, ".report"))
        if write_report else None)


# --- checks ---

def _identity(path: Path) -> tuple:
    """Same file <=> same identity: the real path, or device and inode for hard links."""
    try:
        info = path.stat()
        return ("inode", info.st_dev, info.st_ino)
    except OSError:
        return ("path", os.path.realpath(path))


def check_input(path: Path) -> None:
    if path.is_dir():
        raise UsageError(f"{path}: the input is a folder; give a JSONL file")
    if not path.is_file():
        raise UsageError(f"{path}: no such input file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the input: {exc.strerror}") from None


def check_distinct(paths: JobPaths) -> None:
    """The input and every target are different files, links resolved."""
    seen: dict[tuple, tuple[str, Path]] = {_identity(paths.input): ("input", paths.input)}
    named = paths.targets() + ([("report folder", paths.report_dir)] if paths.report_dir else [])
    for what, path in named:
        key = _identity(path)
        if key in seen:
            other_what, other = seen[key]
            raise UsageError(f"the {what} {path} is the same file as the {other_what} {other}"
                             + ("" if path == other else " (after resolving links)")
                             + f"; writing it would destroy the {other_what}. Choose another path")
        seen[key] = (what, path)


def check_kinds(paths: JobPaths) -> None:
    if paths.report_dir is not None and paths.report_dir.exists() and not paths.report_dir.is_dir():
        raise UsageError(f"the report folder {paths.report_dir} is a file; give a folder "
                         "(--report-dir) or pass --no-report")
    for what, path in paths.targets():
        if path.is_dir():
            raise UsageError(f"the {what} {path} is a folder; give a file path")
        if path.exists() and not stat.S_ISREG(path.stat().st_mode):
            raise UsageError(f"the {what} {path} is not a regular file")


def check_writable(paths: JobPaths) -> None:
    """Try it: append-open existing files, create a probe file where new ones will go."""
    probed: set[Path] = set()
    for what, path in paths.targets():
        try:
            if path.exists():
                with open(path, "ab"):
                    pass
                continue
            folder = _nearest_existing(path.parent)
            if folder not in probed:
                _probe(folder)
                probed.add(folder)
        except OSError as exc:
            raise UsageError(f"cannot write the {what} {path}: "
                             f"{exc.strerror or exc} ({exc.filename or path})") from None


def _nearest_existing(folder: Path) -> Path:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise NotADirectoryError(20, "not a folder", str(folder))
    return folder


def _probe(folder: Path) -> None:
    handle, name = tempfile.mkstemp(prefix=".pagedgen-probe-", dir=folder)
    os.close(handle)
    os.unlink(name)


def check_paths(paths: JobPaths) -> None:
    """Everything about paths that can be known before the run starts; UsageError if not."""
    check_input(paths.input)
    check_distinct(paths)
    check_kinds(paths)
    check_writable(paths)


# --- one file written by a command other than `run` (profile --json) ---

def check_single_target(what: str, path: Path, inputs: list[tuple[str, Path]],
                        written_by_pagedgen: Callable[[Path], bool]) -> None:
    """The run's path rules for one file a command will write whole (atomically), checked
    before its work starts: never one of its inputs (links resolved), never a folder or a
    special file, never an existing file pagedgen did not write, and its folder must exist
    and take a new file. UsageError otherwise."""
    key = _identity(path)
    for input_what, input_path in inputs:
        if _identity(input_path) == key:
            raise UsageError(f"the {what} {path} is the same file as the {input_what} {input_path}; "
                             f"writing it would destroy the {input_what}. Choose another path")
    if path.is_dir():
        raise UsageError(f"the {what} {path} is a folder; give a file path")
    if not path.parent.is_dir():
        raise UsageError(f"cannot write the {what} {path}: the folder {path.parent} does not exist")
    if path.exists():
        if not stat.S_ISREG(path.stat().st_mode):
            raise UsageError(f"the {what} {path} is not a regular file")
        if path.stat().st_size > 0 and not written_by_pagedgen(path):
            raise UsageError(f"the {what} {path} already exists and was not written by pagedgen; "
                             "it will not be replaced. Move it away or choose another path")
    try:
        _probe(path.parent)
    except OSError as exc:
        raise UsageError(f"cannot write the {what} {path}: {exc.strerror or exc}") from None
