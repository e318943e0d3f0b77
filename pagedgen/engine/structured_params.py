"""What a request's output must look like (vLLM's `StructuredOutputsParams`), checked for shape.

Exactly one kind per request: a JSON schema (`json`, a dict or its JSON text), any JSON object
(`json_object=True`), a regular expression (`regex`), one of a list of strings (`choice`), or
a grammar (`grammar`: GBNF-style EBNF as vLLM takes it, or Lark). Only the shape is checked
here; whether the schema / regex / grammar itself is valid is known when it is compiled
(engine/structured_outputs.py), and a bad one fails that request alone.

Torch-free and library-free: building SamplingParams never imports the grammar engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    # JSON kinds: compact JSON, no free whitespace between tokens (vLLM's option). Small or
    # weakly trained models otherwise tend to emit whitespace until max_tokens cuts them off.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            found = f" (got {', '.join(given)})" if given else ""
            raise ValueError("structured_outputs needs exactly one of "
                             f"{', '.join(KINDS)}{found}")
        _check_kind(given[0], getattr(self, given[0]))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false, "
                             f"got {self.disable_any_whitespace!r}")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))  # hashable: a cache key

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, compact): equal constraints share one compiled grammar."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            value = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(value))
        return kind, str(value), self.disable_any_whitespace

    @classmethod
    def from_dict(cls, value: Any) -> StructuredOutputsParams:
        """From a JSONL field: {"json": {...}} / {"regex": "..."} / ...; ValueError names the key."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object with one of "
                             f"{', '.join(KINDS)}, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ValueError(f"structured_outputs has unknown key {unknown[0]!r} "
                             f"(allowed: {', '.join(known)})")
        return cls(**value)


def _check_kind(kind: str, value: Any) -> None:
    if kind == "json" and not isinstance(value, (dict, str)):
        raise ValueError(f"structured_outputs.json must be a JSON schema object or its JSON "
                         f"text, got {value!r}")
    if kind == "json_object" and value is not True:
        raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
    if kind == "choice" and (not isinstance(value, (list, tuple)) or not value
                             or not all(isinstance(c, str) and c for c in value)):
        raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                         f"strings, got {value!r}")
