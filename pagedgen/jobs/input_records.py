"""JSONL lines -> validated requests.

Each non-blank line is one JSON object in one of these shapes (any mix in one file):

    {"prompt": "..."}                                  plain text
    {"messages": [{"role": "user", "content": "..."}]} chat, through the model's chat template
    {"prompt_token_ids": [1, 2, 3]}                    pre-tokenised
    {"custom_id": ..., "method": "POST", "url": ..., "body": {...}}   OpenAI Batch API

Plain lines take an optional "id" (string or integer; default: the line number) and any
sampling field of `SAMPLING_FIELDS`, which override the config's defaults. A line that cannot
run becomes a `RequestError` naming its line number; the other lines are unaffected. The file
is read as bytes and decoded per line, so one line of invalid UTF-8 spoils only that line.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from pagedgen.jobs import openai_batch
from pagedgen.engine.sampling_params import (PARALLEL_FIELDS, REQUEST_RULES, check_combination,
                                             check_field)
from pagedgen.prompts import validate_messages, validate_prompt_text, validate_token_ids
from pagedgen.validation import brief, is_int, shorten

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")


# Sampling fields and their rules are SamplingParams' own table (plus beam search's two
# fields): one set of rules for the API, the JSONL lines, the OpenAI batch bodies and the config.
SAMPLING_FIELDS = REQUEST_RULES


def unknown_key_message(key: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"unknown key {brief(key)}" + (f" (did you mean {close[0]!r}?)" if close else "")


def validate_sampling_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Checked, normalised copy of `values`; ValueError names the first bad key."""
    checked = {}
    for key, value in values.items():
        if key not in SAMPLING_FIELDS:
            raise ValueError(unknown_key_message(str(key), list(SAMPLING_FIELDS)))
        checked[key] = check_field(key, value)
    return checked


check_sampling_combination = check_combination


# --- requests ---

@dataclass(slots=True)
class Request:
    line: int                                   # 1-based line number in the input file
    id: str | int                               # "id", "custom_id", or the line number
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    openai_url: str | None = None               # set for OpenAI Batch API lines
    size: int = 0                               # bytes of the line, checked again after loading

    @property
    def key(self) -> str:
        """Identity used for duplicates and --resume (ids 7 and "7" are the same request)."""
        return str(self.id)


@dataclass(slots=True)
class RequestError:
    line: int
    reason: str
    id: str | int | None = None                 # when the line got far enough to name one
    openai: bool = False                        # answer in the OpenAI batch format

    @property
    def message(self) -> str:
        return f"line {self.line}: {self.reason}"

    @classmethod
    def of(cls, request: Request, reason: str) -> RequestError:
        return cls(request.line, reason, request.id, request.openai_url is not None)


def _validate_prompt(kind: str, value: Any) -> Any:
    """One rule for the API and the JSONL lines (pagedgen/prompts.py)."""
    if kind == "messages":
        return validate_messages(value)
    if kind == "prompt_token_ids":
        return validate_token_ids(value, "'prompt_token_ids'")
    return validate_prompt_text(value, "'prompt'")


def _validate_id(value: Any) -> str | int:
    if not ((isinstance(value, str) and value) or is_int(value)):
        raise ValueError(f"'id' must be a non-empty string or an integer, got {brief(value)}")
    return value


def _plain_request(line: int, obj: dict[str, Any], defaults: dict[str, Any]) -> Request:
    kinds = [k for k in PROMPT_KEYS if k in obj]
    if len(kinds) != 1:
        raise ValueError("needs exactly one of 'prompt', 'messages' or 'prompt_token_ids'"
                         + (f" (found {', '.join(kinds)})" if kinds else ""))
    request = Request(line, _validate_id(obj.get("id", line)))
    setattr(request, kinds[0], _validate_prompt(kinds[0], obj[kinds[0]]))
    rest = {k: v for k, v in obj.items() if k not in ("id", kinds[0])}
    unknown = [k for k in rest if k not in SAMPLING_FIELDS]
    if unknown:
        raise ValueError(unknown_key_message(unknown[0], [*SAMPLING_FIELDS, "id", *PROMPT_KEYS]))
    request.sampling = {**defaults, **validate_sampling_fields(rest)}
    return request


def _openai_request(line: int, obj: dict[str, Any], defaults: dict[str, Any]) -> Request:
    parsed = openai_batch.parse_batch_line(obj)
    request = Request(line, parsed.custom_id, openai_url=parsed.url)
    setattr(request, parsed.prompt_kind, _validate_prompt(parsed.prompt_kind, parsed.prompt))
    request.sampling = {**defaults, **validate_sampling_fields(parsed.sampling)}
    return request


@dataclass(frozen=True, slots=True)
class LineLimits:
    """What one line may cost before anything is done with it."""
    max_bytes: int = 64 * 2**20          # a longer line is refused unread
    max_parallel: int | None = None      # max_num_seqs: n (and the like) above it can never run


WRAP_HINT = 'to send a text as a prompt, write the line as {"prompt": "your text"}'
PLAIN_TEXT_HINT = f"plain text, not JSON: each line must be one JSON object; {WRAP_HINT}"

# Deeper JSON is refused: no request needs it, and walking it costs stack.
MAX_JSON_DEPTH = 64


def _decode(line: int, raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"invalid UTF-8 at byte offset {exc.start}") from None
    try:
        obj = json.loads(text.lstrip("\ufeff") if line == 1 else text)
    except json.JSONDecodeError as exc:
        if not text.lstrip("\ufeff \t").startswith(("{", "[", '"')):
            raise ValueError(PLAIN_TEXT_HINT) from None
        raise ValueError(f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:  # Python refuses to parse integers of more than 4300 digits
        raise ValueError("invalid JSON: a number has too many digits") from None
    _check_tree(obj)
    return obj


def _check_tree(obj: Any) -> None:
    """Depth and text checks on a parsed line, without recursion: JSON escapes can smuggle
    lone surrogates (\\ud800) into strings that no tokenizer or UTF-8 file can hold."""
    stack: list[tuple[Any, str, int]] = [(obj, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"{where}.{brief(key, 30)}" if where else brief(key, 30))
                stack.append((item, f"{where}.{key[:30]}" if where else key[:30], depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        place = f" in {where}" if where else ""
        raise ValueError(f"lone surrogate {brief(text[exc.start])}{place} (character {exc.start}): "
                         "not valid Unicode") from None


def parse_line(line: int, raw: bytes, defaults: dict[str, Any],
               limits: LineLimits = LineLimits()) -> Request | RequestError:
    """One input line -> a Request or a RequestError naming the line and the reason; nothing
    on one line, however malformed, raises out of here."""
    obj, openai = None, False
    try:
        if len(raw) > limits.max_bytes:
            raise ValueError(line_too_long(limits.max_bytes))
        obj = _decode(line, raw)
        if not isinstance(obj, dict):
            hint = f"; {WRAP_HINT}" if isinstance(obj, str) else ""
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}{hint}")
        openai = openai_batch.is_batch_line(obj)
        request = (_openai_request if openai else _plain_request)(line, obj, defaults)
        request.size = len(raw)
        check_sampling_combination(request.sampling)
        check_parallel(request.sampling, limits.max_parallel)
        return request
    except ValueError as exc:
        return RequestError(line, str(exc), _id_for_error(obj, line, openai), openai)
    except Exception as exc:  # noqa: BLE001 - whatever one line does, it stays that line's error
        return RequestError(line, f"cannot read this line: {type(exc).__name__}: {shorten(str(exc))}",
                            _id_for_error(obj, line, openai), openai)


# The default line limit: 32 bytes per token of the longest prompt that fits is about 8x its
# text (~4 bytes a token), room for JSON escapes (\\uXXXX is 6 bytes) and chat framing.
BYTES_PER_TOKEN = 32
MIN_LINE_BYTES = 64 * 2**10
UNKNOWN_LEN_LINE_BYTES = 64 * 2**20   # before the model is loaded, when max_model_len is unset


def line_byte_limit(max_line_bytes: int | None, max_model_len: int | None) -> int:
    """The configured limit, else one derived from the longest prompt that can fit."""
    if max_line_bytes is not None:
        return max_line_bytes
    if max_model_len is None:
        return UNKNOWN_LEN_LINE_BYTES
    return max(MIN_LINE_BYTES, BYTES_PER_TOKEN * max_model_len)


def line_too_long(limit: int) -> str:
    return (f"the line is longer than the limit of {limit} bytes (max_line_bytes, "
            "--max-line-bytes); it was not parsed")


def check_parallel(sampling: dict[str, Any], max_parallel: int | None) -> None:
    """n (and any other PARALLEL_FIELDS) take max_num_seqs seats side by side."""
    for name in PARALLEL_FIELDS:
        if max_parallel is not None and sampling.get(name, 1) > max_parallel:
            raise ValueError(f"{name!r} is {sampling[name]}, more than max_num_seqs "
                             f"({max_parallel}): the sequences of one request run side by side; "
                             "lower it or raise --max-num-seqs")


def _id_for_error(obj: Any, line: int, openai: bool) -> str | int | None:
    """Best-effort id for an error record, so the caller can match it to their input."""
    if not isinstance(obj, dict):
        return None
    value = obj.get("custom_id") if openai else obj.get("id", line)
    if isinstance(value, str) and value and len(value) <= 1024:
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return None
    return value if is_int(value) and value.bit_length() <= 64 else None


def iter_lines(path: str | Path, max_bytes: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of every non-blank line; binary so bad UTF-8 stays per line. A line
    longer than `max_bytes` is not held in memory: its first max_bytes + 1 bytes stand for it."""
    with open(path, "rb") as handle:
        number = 0
        while True:
            raw = handle.readline(-1 if max_bytes is None else max_bytes + 2)
            if not raw:
                return
            number += 1
            if not raw.endswith(b"\n") and max_bytes is not None and len(raw) > max_bytes:
                _skip_rest_of_line(handle)
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield number, raw


def _skip_rest_of_line(handle: Any) -> None:
    while True:
        chunk = handle.readline(1 << 20)
        if not chunk or chunk.endswith(b"\n"):
            return


def read_requests(path: str | Path, defaults: dict[str, Any],
                  limits: LineLimits = LineLimits()) -> list[Request | RequestError]:
    """Every non-blank line of `path` in order; a repeated id makes the later line an error."""
    entries: list[Request | RequestError] = []
    first_line_of: dict[str, int] = {}
    for number, raw in iter_lines(path, limits.max_bytes):
        entry = parse_line(number, raw, defaults, limits)
        if isinstance(entry, Request):
            if entry.key in first_line_of:
                entry = RequestError.of(entry, f"duplicate id {brief(entry.id)} "
                                               f"(first used on line {first_line_of[entry.key]})")
            else:
                first_line_of[entry.key] = number
        entries.append(entry)
    return entries
