"""The OpenAI Batch API format: request lines in, batch output records out.

In:  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Out: {"id": "batch_req_...", "custom_id": "r1",
      "response": {"status_code": 200, "request_id": "...", "body": <chat.completion or
                   text_completion object with choices and usage>},
      "error": null}
A request that cannot run is answered with "response": null and "error": {"code", "message"}
(written to the errors file, as OpenAI's own batches put failures in a separate error file).

This module only translates; input_records.py validates the translated values.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedgen.validation import brief

if TYPE_CHECKING:
    from pagedgen.jobs.results import SampleResult, TokenLogprob

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
LINE_KEYS = ("custom_id", "method", "url", "body")

# Body fields with the same meaning in SamplingParams (the last six are vLLM's extensions).
_DIRECT = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "stop",
           "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
           "structured_outputs", "prompt_logprobs")
# Fields that do not change what is generated offline: accepted and ignored, so existing
# batch files run unchanged ("model" is whatever the config loads).
_IGNORED = ("model", "user", "metadata", "store", "service_tier", "stream_options")
# Fields accepted only at their no-op value.
_NO_OP = {"stream": (False,), "echo": (False,), "best_of": (None, 1), "logit_bias": (None, {}),
          "suffix": (None, "")}


@dataclass(slots=True)
class BatchLine:
    custom_id: str
    url: str
    prompt_kind: str                  # "messages", "prompt" or "prompt_token_ids"
    prompt: Any
    sampling: dict[str, Any] = field(default_factory=dict)


def _json(value: Any) -> str:
    """A value as the user wrote it in the batch file (true, null, "text"), not Python's repr;
    long or nested values are cut, never copied whole into a message."""
    if isinstance(value, str):
        return json.dumps(value[:60], ensure_ascii=False) + ("…" if len(value) > 60 else "")
    if isinstance(value, (bool, float, type(None))) or (isinstance(value, int) and value.bit_length() <= 64):
        return json.dumps(value)
    short = brief(value)
    return short if short.startswith("<") else json.dumps(value, ensure_ascii=False)


def _key(key: str) -> str:
    return key if len(key) <= 60 else key[:60] + "…"


def is_batch_line(obj: dict[str, Any]) -> bool:
    return "custom_id" in obj or ("url" in obj and "body" in obj)


def _check_envelope(obj: dict[str, Any]) -> None:
    extra = [k for k in obj if k not in LINE_KEYS]
    if extra:
        raise ValueError(f"unknown key {brief(extra[0])} in a batch line (allowed: {', '.join(LINE_KEYS)})")
    if not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        raise ValueError("'custom_id' must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"'method' must be \"POST\", got {_json(obj.get('method'))}")
    if obj.get("url") not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"'url' must be {_json(CHAT_URL)} or {_json(COMPLETIONS_URL)}, "
                         f"got {_json(obj.get('url'))}")
    if not isinstance(obj.get("body"), dict):
        raise ValueError("'body' must be an object")


def _completion_prompt(body: dict[str, Any]) -> tuple[str, Any]:
    """/v1/completions prompt: a string, token ids, or a list holding exactly one of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ValueError("body.prompt holds several prompts; use one batch line per prompt")
    return ("prompt" if isinstance(prompt, str) or prompt is None else "prompt_token_ids"), prompt


def _logprobs(url: str, body: dict[str, Any]) -> int | None:
    """Chat: logprobs is a bool and top_logprobs the count; completions: logprobs is the count."""
    if url == COMPLETIONS_URL:
        return body.get("logprobs")
    top = body.get("top_logprobs")
    if top is not None and body.get("logprobs") is not True:
        raise ValueError("body.top_logprobs needs body.logprobs = true")
    if body.get("logprobs") not in (None, True, False):
        raise ValueError(f"body.logprobs must be true or false, got {_json(body.get('logprobs'))}")
    return (top or 0) if body.get("logprobs") else None


def _sampling(url: str, body: dict[str, Any]) -> dict[str, Any]:
    sampling = {k: body[k] for k in _DIRECT if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    logprobs = _logprobs(url, body)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    structured = _response_format(body.get("response_format"))
    if structured is not None:
        if "structured_outputs" in sampling:
            raise ValueError("give body.response_format or body.structured_outputs, not both")
        sampling["structured_outputs"] = structured
    return sampling


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format -> structured_outputs ("strict" is always on here: the
    output is constrained to the schema whatever it says)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise ValueError('body.response_format must be {"type": "text"}, {"type": '
                         '"json_object"} or {"type": "json_schema", "json_schema": {...}}, '
                         f"got {_json(value)}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError("body.response_format.json_schema must be an object with a 'name' "
                         "and a 'schema'")
    schema = spec.get("schema")
    if schema is None:
        return {"json_object": True}
    if not isinstance(schema, dict):
        raise ValueError("body.response_format.json_schema.schema must be a JSON schema object, "
                         f"got {_json(schema)}")
    return {"json": schema}


def _check_body_keys(url: str, body: dict[str, Any]) -> None:
    known = {*_DIRECT, *_IGNORED, "max_tokens", "max_completion_tokens", "logprobs", "response_format",
             "messages" if url == CHAT_URL else "prompt", *(("top_logprobs",) if url == CHAT_URL else ())}
    for key, value in body.items():
        if key in _NO_OP:
            if value not in _NO_OP[key]:
                raise ValueError(f"body.{_key(key)} = {_json(value)} is not supported offline")
        elif key not in known:
            raise ValueError(f"body.{_key(key)} is not supported")


def parse_batch_line(obj: dict[str, Any]) -> BatchLine:
    """Translate one batch line; ValueError says what is wrong."""
    _check_envelope(obj)
    url, body = obj["url"], obj["body"]
    _check_body_keys(url, body)
    if url == CHAT_URL:
        kind, prompt = "messages", body.get("messages")
    else:
        kind, prompt = _completion_prompt(body)
    return BatchLine(obj["custom_id"], url, kind, prompt, _sampling(url, body))


# --- output ---

def _chat_logprobs(tokens: list[TokenLogprob]) -> dict[str, Any]:
    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    content = [{**entry(t.token, t.logprob), "top_logprobs": [entry(a.token, a.logprob) for a in t.top]}
               for t in tokens]
    return {"content": content, "refusal": None}


def _completion_logprobs(tokens: list[TokenLogprob]) -> dict[str, Any]:
    offsets, position = [], 0
    for t in tokens:
        offsets.append(position)
        position += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in tokens],
            "text_offset": offsets}


def _choice(url: str, sample: SampleResult) -> dict[str, Any]:
    if url == CHAT_URL:
        logprobs = None if sample.logprobs is None else _chat_logprobs(sample.logprobs)
        return {"index": sample.index, "message": {"role": "assistant", "content": sample.text},
                "logprobs": logprobs, "finish_reason": sample.finish_reason}
    logprobs = None if sample.logprobs is None else _completion_logprobs(sample.logprobs)
    return {"index": sample.index, "text": sample.text, "logprobs": logprobs,
            "finish_reason": sample.finish_reason}


def response_record(custom_id: str, url: str, model: str, samples: list[SampleResult],
                    usage: dict[str, Any], prompt_logprobs: list | None = None) -> dict[str, Any]:
    """A successful batch output line (prompt_logprobs: vLLM's extension of the body)."""
    chat = url == CHAT_URL
    body = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [_choice(url, s) for s in samples], "usage": usage}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
            "error": None}


def error_record(custom_id: str | None, line: int, message: str) -> dict[str, Any]:
    """A failed batch output line (custom_id is None when the line was unreadable)."""
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id, "response": None,
            "error": {"code": "invalid_request", "message": message, "line": line}}
