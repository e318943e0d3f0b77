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

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from pagedgen.cli import openai_batch
from pagedgen.cli.input_records import Request, RequestError
from pagedgen.cli.results import SampleResult, TokenLogprob


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


def encode_line(record: dict[str, Any]) -> bytes:
    # ensure_ascii=False keeps text readable; one line per record is guaranteed because JSON
    # escapes newlines inside strings. A lone surrogate (input lines are checked for them) would
    # be written as its JSON escape rather than fail the write.
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")


# --- streaming ---

class JsonlAppender:
    """Appends one record per line; flushes every line, fsyncs every N lines / T seconds."""

    def __init__(self, path: str | Path, fsync_every: int = 32, fsync_seconds: float = 2.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        self._fsync_every, self._fsync_seconds = fsync_every, fsync_seconds
        self._unsynced, self._last_sync = 0, time.monotonic()
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        self.write_line(encode_line(record))

    def write_line(self, line: bytes) -> None:
        """One encoded record (`encode_line`), newline included."""
        self._file.write(line)
        self._file.flush()
        self.count += 1
        self._unsynced += 1
        if self._unsynced >= self._fsync_every or time.monotonic() - self._last_sync > self._fsync_seconds:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._file.fileno())
        self._unsynced, self._last_sync = 0, time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self.sync()
            self._file.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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


def write_atomically(path: str | Path, lines: Iterable[bytes]) -> None:
    """Write to PATH.tmp, fsync, rename: readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        handle.writelines(lines)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


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
