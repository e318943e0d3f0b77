"""Results to disk: streamed, flushed, resumable; an errors file; an input-ordered copy.

- OUTPUT (JSONL): one line per finished request, appended in completion order, flushed at once
  and fsync'd every few records / seconds and at close, so an interruption loses no finished
  work. Only successes go here, so `--resume` can skip exactly the ids found in it.
- ERRORS (JSONL): one record per request that could not run, naming the input line; rewritten
  by every run (a resumed run retries failed requests).
- ORDERED (JSONL): at the end of a complete run, results and errors in input order, written to a
  temporary name and renamed, so a partial file never looks complete.

Plain requests are answered as {"id", "line", "outputs": [...], "usage"}; OpenAI batch lines as
OpenAI batch output records (see openai_batch.py).
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from pagedgen.jobs import openai_batch
from pagedgen.jobs.input_records import Request, RequestError
from pagedgen.jobs.results import SampleResult, TokenLogprob


class OutputFileError(ValueError):
    """An existing output file cannot be resumed from (names the file and line)."""


@dataclass(slots=True)
class RequestResult:
    request: Request
    prompt_tokens: int
    samples: list[SampleResult]
    model: str = ""
    cached_prompt_tokens: int = 0    # prompt tokens served from the prefix cache
    # vLLM's JSON shape: [null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None

    @property
    def usage(self) -> dict[str, int]:
        completion = sum(len(s.token_ids) for s in self.samples)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


# --- records ---

def _logprob_record(t: TokenLogprob) -> dict[str, Any]:
    return {"token_id": t.token_id, "token": t.token, "logprob": t.logprob,
            "top": [{"token_id": a.token_id, "token": a.token, "logprob": a.logprob} for a in t.top]}


def _sample_record(sample: SampleResult) -> dict[str, Any]:
    record = {"index": sample.index, "text": sample.text, "token_ids": sample.token_ids,
              "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}
    if sample.logprobs is not None:
        record["logprobs"] = [_logprob_record(t) for t in sample.logprobs]
    if sample.beam_scores is not None:
        record.update(sample.beam_scores)
    return record


def result_record(result: RequestResult) -> dict[str, Any]:
    request = result.request
    if request.openai_url is not None:
        usage = {**result.usage, "prompt_tokens_details": {"cached_tokens": result.cached_prompt_tokens}}
        return openai_batch.response_record(str(request.id), request.openai_url, result.model,
                                            result.samples, usage, result.prompt_logprobs)
    record = {"id": request.id, "line": request.line,
              "outputs": [_sample_record(s) for s in result.samples],
              "usage": {**result.usage, "cached_prompt_tokens": result.cached_prompt_tokens}}
    if result.prompt_logprobs is not None:
        record["prompt_logprobs"] = result.prompt_logprobs
    return record


def error_record(error: RequestError) -> dict[str, Any]:
    if error.openai:
        custom_id = None if error.id is None else str(error.id)
        return openai_batch.error_record(custom_id, error.line, error.message)
    return {"id": error.id, "line": error.line,
            "error": {"code": "invalid_request", "message": error.message}}


def record_key(record: dict[str, Any]) -> str:
    """The request key of an output record (custom_id for batch records, else id)."""
    return str(record["custom_id"] if "custom_id" in record else record["id"])


# Characters that JSON leaves raw but that Python's str.splitlines (and some editors and
# JavaScript readers) treat as line ends: written as escapes, a record stays one line for them too.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                         "\u2029": "\\u2029"})


def encode_line(record: dict[str, Any]) -> bytes:
    # ensure_ascii=False keeps text readable; one line per record is guaranteed because JSON
    # escapes newlines inside strings. A lone surrogate (input lines are checked for them) would
    # be written as its JSON escape rather than fail the write.
    text = json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS_JSON_KEEPS)
    return (text + "\n").encode("utf-8", "backslashreplace")


# --- streaming ---

class OutputWriteError(Exception):
    """Writing an output file failed (disk full, quota, I/O error): the file and the errno.

    Not an internal error: the answers already written are intact (no partial line is left
    behind, no temporary file), and `--resume` continues from them once the cause is fixed."""

    def __init__(self, path: str | Path, error: OSError):
        self.path, self.errno = Path(path), error.errno
        self.strerror = error.strerror or str(error)
        name = errno_name(error.errno)
        super().__init__(f"cannot write {self.path}: {self.strerror}" + (f" ({name})" if name else ""))


def errno_name(number: int | None) -> str:
    return errno.errorcode.get(number, "") if number is not None else ""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class JsonlAppender:
    """Appends one record per line; fsyncs every N lines / T seconds and at close.

    Each line goes to the kernel in one unbuffered write; a write that fails (disk full) is
    undone by truncating the file back to where the line began, so a line is on disk whole or
    not at all, and the failure is an OutputWriteError naming the file."""

    def __init__(self, path: str | Path, fsync_every: int = 32, fsync_seconds: float = 2.0):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND
                                           | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise OutputWriteError(self.path, exc) from None
        self._fsync_every, self._fsync_seconds = fsync_every, fsync_seconds
        self._unsynced, self._last_sync = 0, time.monotonic()
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        self.write_line(encode_line(record))

    def write_line(self, line: bytes) -> None:
        """One encoded record (`encode_line`), newline included."""
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            _write_all(self._fd, line)
        except OSError as exc:
            self._undo(start)
            raise OutputWriteError(self.path, exc) from None
        self.count += 1
        self._unsynced += 1
        if self._unsynced >= self._fsync_every or time.monotonic() - self._last_sync > self._fsync_seconds:
            self.sync()

    def _undo(self, start: int) -> None:
        try:        # truncating frees blocks, so it works on a full disk too
            os.ftruncate(self._fd, start)
        except OSError:
            pass    # --resume drops a partial last line anyway

    def sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise OutputWriteError(self.path, exc) from None
        self._unsynced, self._last_sync = 0, time.monotonic()

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        except OSError as exc:
            raise OutputWriteError(self.path, exc) from None
        finally:
            os.close(fd)

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:     # already failing: do not hide that error behind a second one
            self.close()
        except OutputWriteError:
            pass


def truncate_partial_line(path: str | Path) -> int:
    """Cut bytes after the last newline (a line cut off by a kill); returns bytes removed."""
    with open(path, "r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            step = min(1 << 16, end)
            handle.seek(end - step)
            chunk = handle.read(step)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                end = end - step + newline + 1
                break
            end -= step
        if end < size:
            handle.truncate(end)
            os.fsync(handle.fileno())
        return size - end


def read_keyed_lines(path: str | Path) -> Iterable[tuple[bytes, str]]:
    """(raw line, request key) of each line of a complete output file; damage is an error."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                key = record_key(json.loads(raw))
            except (ValueError, KeyError, TypeError):
                raise OutputFileError(f"{path}: line {number} is not a result record; "
                                      "refusing to resume over a damaged output file") from None
            yield raw, key


def completed_keys(path: str | Path) -> set[str]:
    """Keys of the requests already answered in `path` (after dropping a partial last line)."""
    if not Path(path).exists():
        return set()
    truncate_partial_line(path)
    return {key for _, key in read_keyed_lines(path)}


@dataclass(slots=True)
class ResumeState:
    """What an earlier run's output holds, checked against the input (`read_resume_state`)."""
    done: set[str]                 # keys answered once or more, all in the input
    kept: list[bytes]              # the first record of each such key, in file order
    duplicates: int = 0            # later records of a key already seen: dropped
    foreign: list[bytes] = field(default_factory=list)   # records whose key is not in the input

    @property
    def needs_tidying(self) -> bool:
        return bool(self.duplicates or self.foreign)


def read_resume_state(path: str | Path, input_keys: set[str]) -> ResumeState:
    """--resume trusts nothing it reads: a partial last line is cut, a damaged line refused,
    a second record of one id dropped (the first is kept), a record of an id the input does
    not hold set aside."""
    state = ResumeState(set(), [])
    if not Path(path).exists():
        return state
    truncate_partial_line(path)
    for raw, key in read_keyed_lines(path):
        if key not in input_keys:
            state.foreign.append(raw)
        elif key in state.done:
            state.duplicates += 1
        else:
            state.done.add(key)
            state.kept.append(raw)
    return state


def tidy_output(path: str | Path, state: ResumeState, foreign_path: str | Path) -> None:
    """Foreign records appended to `foreign_path` first (so none is lost if this stops midway),
    then the output replaced by its kept records."""
    if state.foreign:
        with JsonlAppender(foreign_path) as aside:
            for raw in state.foreign:
                aside.write_line(raw)
    write_atomically(path, state.kept)


def write_atomically(path: str | Path, lines: Iterable[bytes]) -> None:
    """Write to PATH.tmp, fsync, rename: readers see the old file or the whole new one. On a
    failed write the temporary file is removed (nothing is left on a full disk) and
    OutputWriteError names the target."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise OutputWriteError(path, exc) from None
    try:
        try:
            for line in lines:
                _write_all(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise OutputWriteError(path, exc) from None
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_ordered(output_path: str | Path, ordered_path: str | Path,
                  entries: list[Request | RequestError]) -> None:
    """Results from OUTPUT plus the errors, in input order (one line per input request)."""
    results = {key: raw for raw, key in read_keyed_lines(output_path)} \
        if Path(output_path).exists() else {}

    def lines() -> Iterable[bytes]:
        for entry in entries:
            if isinstance(entry, RequestError):
                yield encode_line(error_record(entry))
            else:
                yield results[entry.key]
    missing = [e.key for e in entries if isinstance(e, Request) and e.key not in results]
    if missing:
        raise OutputFileError(f"{output_path}: no result for id {missing[0]!r}; "
                              "cannot write the ordered file of an incomplete run")
    write_atomically(ordered_path, lines())
