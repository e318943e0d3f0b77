"""Dataset rows <-> pagedgen requests and results, through the `pagedgen run` line rules.

A row is one of:
- ``{"input_line": "<one JSONL line>", "line": 7}``: the text of a `pagedgen run` input line
  (any shape it accepts, OpenAI batch lines included); ``line`` numbers error messages;
- the fields of such a line as columns: ``prompt`` / ``messages`` / ``prompt_token_ids``, an
  optional ``id`` and sampling fields, or Ray's ``sampling_params`` mapping of them.
  Other columns are not read (a dataset's rows share one schema, so a column the stage
  does not know is the caller's own and is carried through to the output).

Either way the row becomes a JSON line and goes through `input_records.parse_line`: the same
checks and messages as `pagedgen run`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pagedgen.jobs.input_records import (PROMPT_KEYS, SAMPLING_FIELDS, Request, RequestError,
                                        parse_line)

INPUT_LINE, LINE = "input_line", "line"
_OPENAI_KEYS = ("custom_id", "method", "url", "body")
_ROW_KEYS = (*PROMPT_KEYS, "id", *SAMPLING_FIELDS)


def _present(value: Any) -> bool:
    """A dataset fills a column a row lacks with null (NaN for floats): both mean 'absent'."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def line_object(row: dict[str, Any]) -> dict[str, Any]:
    """The input-line object a field-per-column row stands for."""
    if _present(row.get("custom_id")):   # an OpenAI batch line
        return {k: row[k] for k in _OPENAI_KEYS if _present(row.get(k))}
    line = {k: row[k] for k in _ROW_KEYS if _present(row.get(k))}
    sampling = row.get("sampling_params")
    if isinstance(sampling, dict):
        line.update({k: v for k, v in sampling.items() if _present(v)})
    return line


def row_request(row: dict[str, Any], defaults: dict[str, Any]) -> Request | RequestError:
    """The row as a checked Request, or a RequestError with the reason."""
    line = row.get(LINE) if isinstance(row.get(LINE), int) else 0
    if _present(row.get(INPUT_LINE)):
        raw = row[INPUT_LINE]
        raw = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
    else:
        raw = json.dumps(line_object(row)).encode("utf-8")
    return parse_line(line, raw, defaults)
