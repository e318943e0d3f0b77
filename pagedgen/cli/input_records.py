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
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from pagedgen.cli import openai_batch
from pagedgen.validation import int_at_least, is_int

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")


# --- sampling fields: name -> check that returns the value or raises ValueError(requirement) ---

def _is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _number_in(low: float, high: float, low_open: bool = False) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        inside = _is_number(value) and (value > low if low_open else value >= low) and value <= high
        if not inside:
            raise ValueError(f"must be a number in {'(' if low_open else '['}{low}, {high}]")
        return float(value)
    return check


def _top_k(value: Any) -> int:
    if not is_int(value) or value < -1:
        raise ValueError("must be an integer >= 1, or 0 / -1 for no top-k cut")
    return value


def _optional_seed(value: Any) -> int | None:
    if value is not None and (not is_int(value) or value < 0):
        raise ValueError("must be a non-negative integer or null")
    return value


def _stop(value: Any) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) and s for s in values):
        raise ValueError("must be a non-empty string or a list of non-empty strings")
    return values


def _token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
        raise ValueError("must be a list of non-negative integers")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _optional_logprobs(value: Any) -> int | None:
    if value is not None and (not is_int(value) or not 0 <= value <= 20):
        raise ValueError("must be an integer in [0, 20] (top alternatives per token) or null")
    return value


def _structured_outputs(value: Any) -> dict[str, Any]:
    """Shape only ({"json": ...} / {"regex": ...} / ...); a schema or regex that does not
    compile fails its line when the model's tokenizer compiles it."""
    from pagedgen.engine.structured_params import StructuredOutputsParams

    try:
        StructuredOutputsParams.from_dict(value)
    except ValueError as exc:
        raise ValueError(f"is invalid: {exc}") from None
    return value


def _optional_prompt_logprobs(value: Any) -> int | None:
    if value is not None and (not is_int(value) or not 0 <= value <= 20):
        raise ValueError("must be an integer in [0, 20] (top alternatives per prompt token) "
                         "or null")
    return value


SAMPLING_FIELDS: dict[str, Callable[[Any], Any]] = {
    "n": int_at_least(1),
    "max_tokens": int_at_least(1),
    "min_tokens": int_at_least(0),
    "temperature": _number_in(0.0, 100.0),
    "top_p": _number_in(0.0, 1.0, low_open=True),
    "top_k": _top_k,
    "min_p": _number_in(0.0, 1.0),
    "seed": _optional_seed,
    "stop": _stop,
    "stop_token_ids": _token_ids,
    "ignore_eos": _flag,
    "include_stop_str_in_output": _flag,
    "skip_special_tokens": _flag,
    "logprobs": _optional_logprobs,
    "presence_penalty": _number_in(-2.0, 2.0),
    "frequency_penalty": _number_in(-2.0, 2.0),
    "repetition_penalty": _number_in(0.0, 100.0, low_open=True),
    "structured_outputs": _structured_outputs,
    "prompt_logprobs": _optional_prompt_logprobs,
}


# A line with "beam_width" runs beam search (run_job.prepare builds its BeamSearchParams).
BEAM_SEARCH_FIELDS: dict[str, Callable[[Any], Any]] = {
    "beam_width": int_at_least(1),
    "length_penalty": _number_in(-100.0, 100.0),
}
SAMPLING_FIELDS.update(BEAM_SEARCH_FIELDS)


def unknown_key_message(key: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def validate_sampling_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Checked, normalised copy of `values`; ValueError names the first bad key."""
    checked = {}
    for key, value in values.items():
        if key not in SAMPLING_FIELDS:
            raise ValueError(unknown_key_message(str(key), list(SAMPLING_FIELDS)))
        try:
            checked[key] = SAMPLING_FIELDS[key](value)
        except ValueError as exc:
            raise ValueError(f"{key!r} {exc}, got {value!r}") from None
    return checked


def check_sampling_combination(sampling: dict[str, Any]) -> None:
    """Rules between fields, checked after the line's fields are merged onto the defaults."""
    if sampling.get("min_tokens", 0) > sampling.get("max_tokens", math.inf):
        raise ValueError(f"'min_tokens' ({sampling['min_tokens']}) exceeds 'max_tokens' "
                         f"({sampling['max_tokens']})")


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


def _message_text(index: int, content: Any) -> str:
    """A message's text; OpenAI-style lists of {"type": "text"} parts are joined."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else None
    if parts is None or not all(isinstance(p, dict) and p.get("type") == "text"
                                and isinstance(p.get("text"), str) for p in parts):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return "".join(p["text"] for p in parts)


def _validate_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {'role', 'content'} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"messages[{i}] needs a string 'role' and a 'content'")
        checked.append({"role": message["role"], "content": _message_text(i, message["content"])})
    return checked


def _validate_prompt(kind: str, value: Any) -> Any:
    if kind == "messages":
        return _validate_messages(value)
    if kind == "prompt_token_ids":
        if not value or not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
            raise ValueError("'prompt_token_ids' must be a non-empty list of non-negative integers")
        return value
    if not isinstance(value, str) or not value:
        raise ValueError("'prompt' must be a non-empty string")
    return value


def _validate_id(value: Any) -> str | int:
    if not ((isinstance(value, str) and value) or is_int(value)):
        raise ValueError(f"'id' must be a non-empty string or an integer, got {value!r}")
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


def _decode(line: int, raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"invalid UTF-8 at byte offset {exc.start}") from None
    try:
        return json.loads(text.lstrip("\ufeff") if line == 1 else text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg} (column {exc.colno})") from None


def parse_line(line: int, raw: bytes, defaults: dict[str, Any]) -> Request | RequestError:
    """One input line -> a Request or a RequestError naming the line and the reason."""
    obj, openai = None, False
    try:
        obj = _decode(line, raw)
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        openai = openai_batch.is_batch_line(obj)
        request = (_openai_request if openai else _plain_request)(line, obj, defaults)
        check_sampling_combination(request.sampling)
        return request
    except ValueError as exc:
        return RequestError(line, str(exc), _id_for_error(obj, line, openai), openai)


def _id_for_error(obj: Any, line: int, openai: bool) -> str | int | None:
    """Best-effort id for an error record, so the caller can match it to their input."""
    if not isinstance(obj, dict):
        return None
    value = obj.get("custom_id") if openai else obj.get("id", line)
    return value if (isinstance(value, str) and value) or is_int(value) else None


def iter_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of every non-blank line; binary so bad UTF-8 stays per line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield number, raw


def read_requests(path: str | Path, defaults: dict[str, Any]) -> list[Request | RequestError]:
    """Every non-blank line of `path` in order; a repeated id makes the later line an error."""
    entries: list[Request | RequestError] = []
    first_line_of: dict[str, int] = {}
    for number, raw in iter_lines(path):
        entry = parse_line(number, raw, defaults)
        if isinstance(entry, Request):
            if entry.key in first_line_of:
                entry = RequestError.of(entry, f"duplicate id {entry.id!r} "
                                               f"(first used on line {first_line_of[entry.key]})")
            else:
                first_line_of[entry.key] = number
        entries.append(entry)
    return entries
