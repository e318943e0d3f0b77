"""JSONL lines -> requests: every input kind, the OpenAI batch format, per-line errors."""

import json
import subprocess
from pathlib import Path

import pytest

from pagedgen.jobs import openai_batch
from pagedgen.jobs.input_records import (SAMPLING_FIELDS, Request, RequestError, parse_line, read_requests,
                                        validate_sampling_fields)
from pagedgen.engine.sampling_params import SamplingParams


def parse(obj, defaults=None, line=1):
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return parse_line(line, raw, defaults or {})


def test_prompt_line_with_id_and_overrides():
    request = parse({"id": "a", "prompt": "Hi", "temperature": 0, "stop": "\n"}, {"max_tokens": 8})
    assert isinstance(request, Request)
    assert (request.id, request.prompt, request.key) == ("a", "Hi", "a")
    assert request.sampling == {"max_tokens": 8, "temperature": 0.0, "stop": ["\n"]}


def test_line_number_is_the_default_id():
    request = parse({"prompt_token_ids": [1, 2, 3]}, line=7)
    assert request.id == 7 and request.key == "7" and request.prompt_token_ids == [1, 2, 3]


def test_messages_line_accepts_text_parts():
    request = parse({"messages": [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                               {"type": "text", "text": "!"}]}]})
    assert request.messages == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi!"}]


@pytest.mark.parametrize("obj, fragment", [
    (b'{"prompt": "unterminated', "invalid JSON"),
    (b'{"prompt": "caf\xe9"}', "invalid UTF-8 at byte offset 15"),
    (b'[1, 2]', "expected a JSON object, got list"),
    ({"id": "x"}, "needs exactly one of 'prompt', 'messages' or 'prompt_token_ids'"),
    ({"prompt": "a", "messages": []}, "(found prompt, messages)"),
    ({"prompt": ""}, "'prompt' must be a non-empty string"),
    ({"prompt": 5}, "'prompt' must be a non-empty string"),
    ({"prompt_token_ids": [1, -2]}, "'prompt_token_ids' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "messages[0] needs a string 'role' and a 'content'"),
    ({"messages": "hello"}, "'messages' must be a non-empty list"),
    ({"prompt": "a", "id": 1.5}, "'id' must be a non-empty string or an integer"),
    ({"prompt": "a", "temprature": 1}, "unknown key 'temprature' (did you mean 'temperature'?)"),
    ({"prompt": "a", "max_tokens": 0}, "'max_tokens' must be an integer >= 1, got 0"),
    ({"prompt": "a", "max_tokens": "8"}, "'max_tokens' must be an integer >= 1, got '8'"),
    ({"prompt": "a", "temperature": -1}, "'temperature' must be a number in [0.0, 100.0]"),
    ({"prompt": "a", "top_p": 1.5}, "'top_p' must be a number in (0.0, 1.0]"),
    ({"prompt": "a", "n": True}, "'n' must be an integer >= 1"),
    ({"prompt": "a", "stop": [""]}, "'stop' must be a non-empty string"),
    ({"prompt": "a", "min_tokens": 9, "max_tokens": 4}, "'min_tokens' (9) exceeds 'max_tokens' (4)"),
])
def test_bad_lines_become_errors_naming_the_reason(obj, fragment):
    error = parse(obj, line=4)
    assert isinstance(error, RequestError)
    assert fragment in error.reason and error.message.startswith("line 4: ")


def test_nan_is_rejected_even_though_json_accepts_it():
    error = parse(b'{"prompt": "a", "temperature": NaN}')
    assert isinstance(error, RequestError) and "'temperature'" in error.reason


def test_error_keeps_the_id_when_readable():
    assert parse({"id": "q", "prompt": ""}).id == "q"
    assert parse({"prompt": ""}, line=3).id == 3
    assert parse(b"{oops").id is None


def test_sampling_accepted_here_is_accepted_by_sampling_params():
    """The line-level rules and SamplingParams' own validation agree on valid values."""
    fields = validate_sampling_fields({
        "n": 2, "max_tokens": 5, "min_tokens": 1, "temperature": 0.5, "top_p": 0.9, "top_k": -1,
        "min_p": 0.1, "seed": 3, "stop": "x", "stop_token_ids": [2], "ignore_eos": True,
        "logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.1, "include_stop_str_in_output": True, "skip_special_tokens": False})
    params = SamplingParams(**fields)
    assert params.n == 2 and params.stop == ["x"] and params.top_k == 0


def batch_line(url, body, custom_id="c1"):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_openai_chat_line_maps_fields():
    request = parse(batch_line(openai_batch.CHAT_URL, {
        "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 12, "n": 2, "temperature": 0.2, "top_p": 0.5, "stop": ["."],
        "seed": 9, "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.1,
        "frequency_penalty": 0.2}), {"max_tokens": 100, "top_k": 4})
    assert request.openai_url == openai_batch.CHAT_URL and request.id == "c1"
    assert request.messages == [{"role": "user", "content": "Hi"}]
    assert request.sampling == {"max_tokens": 12, "top_k": 4, "n": 2, "temperature": 0.2,
                                "top_p": 0.5, "stop": ["."], "seed": 9, "logprobs": 3,
                                "presence_penalty": 0.1, "frequency_penalty": 0.2}


def test_openai_completion_line_accepts_text_or_token_ids():
    text = parse(batch_line(openai_batch.COMPLETIONS_URL, {"prompt": ["Once"], "max_tokens": 4,
                                                           "logprobs": 1}))
    assert text.prompt == "Once" and text.sampling == {"max_tokens": 4, "logprobs": 1}
    ids = parse(batch_line(openai_batch.COMPLETIONS_URL, {"prompt": [5, 6]}))
    assert ids.prompt_token_ids == [5, 6]


@pytest.mark.parametrize("line, fragment", [
    (batch_line("/v1/embeddings", {"input": "x"}), "'url' must be"),
    ({"custom_id": "", "url": openai_batch.CHAT_URL, "body": {}}, "'custom_id' must be"),
    (batch_line(openai_batch.CHAT_URL, {"messages": [{"role": "user", "content": "x"}],
                                        "tools": []}), "body.tools is not supported"),
    (batch_line(openai_batch.CHAT_URL, {"messages": [{"role": "user", "content": "x"}],
                                        "stream": True}), "body.stream = true is not supported"),
    # Values are quoted as JSON, the way they appear in the batch file.
    (batch_line(openai_batch.CHAT_URL, {"messages": [{"role": "user", "content": "x"}],
                                        "response_format": {"type": "xml"}}),
     'body.response_format must be {"type": "text"}'),
    (batch_line(openai_batch.COMPLETIONS_URL, {"prompt": "x", "suffix": "end"}),
     'body.suffix = "end" is not supported'),
    (batch_line(openai_batch.CHAT_URL, {"messages": [{"role": "user", "content": "x"}],
                                        "logprobs": "yes"}),
     'body.logprobs must be true or false, got "yes"'),
    ({**batch_line(openai_batch.CHAT_URL, {}), "method": "GET"},
     "'method' must be \"POST\", got \"GET\""),
    (batch_line("/v1/embeddings", {"input": "x"}), 'got "/v1/embeddings"'),
    (batch_line(openai_batch.CHAT_URL, {"messages": [{"role": "user", "content": "x"}],
                                        "top_logprobs": 2}), "needs body.logprobs = true"),
    (batch_line(openai_batch.CHAT_URL, {"messages": [{"role": "user", "content": "x"}],
                                        "temperature": 500}), "'temperature' must be a number"),
    (batch_line(openai_batch.COMPLETIONS_URL, {"prompt": ["a", "b"]}), "several prompts"),
    (batch_line(openai_batch.COMPLETIONS_URL, {}), "'prompt' must be a non-empty string"),
    ({**batch_line(openai_batch.CHAT_URL, {}), "extra": 1}, "unknown key 'extra'"),
])
def test_openai_errors_are_answered_in_openai_format(line, fragment):
    error = parse(line)
    assert isinstance(error, RequestError) and error.openai and fragment in error.reason


def test_read_requests_keeps_order_skips_blank_lines_and_flags_duplicates(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "x"}\n\n   \n{"prompt": "y"}\r\n'
                     b'{"id": "a", "prompt": "z"}\n\xff\xfe\n{"id": 4, "prompt": "w"}')
    entries = read_requests(path, {"max_tokens": 3})
    assert [e.line for e in entries] == [1, 4, 5, 6, 7]
    assert [type(e).__name__ for e in entries] == ["Request", "Request", "RequestError",
                                                   "RequestError", "RequestError"]
    assert "duplicate id 'a' (first used on line 1)" in entries[2].reason
    assert "invalid UTF-8" in entries[3].reason
    assert "duplicate id 4 (first used on line 4)" in entries[4].reason  # id 4 == line-number id
    assert entries[1].sampling == {"max_tokens": 3}


def test_a_bom_on_the_first_line_is_tolerated(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "x"}\n')
    assert isinstance(read_requests(path, {})[0], Request)


def shipped_samples() -> list[Path]:
    """The sample inputs the repository ships. Not a plain glob: `pagedgen run samples/x.jsonl`
    writes its outputs next to its input (samples/x.completions*.jsonl), and they are no samples."""
    root = Path(__file__).resolve().parent.parent
    try:
        listed = subprocess.run(["git", "ls-files", "samples/*.jsonl"], cwd=root,
                                capture_output=True, text=True).stdout.split()
    except OSError:  # no git: an unpacked source archive
        listed = []
    if listed:
        return sorted(root / name for name in listed)
    return sorted(p for p in (root / "samples").glob("*.jsonl") if ".completions" not in p.name)


SAMPLES = shipped_samples()


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.name for p in SAMPLES])
def test_shipped_samples_are_valid(sample):
    entries = read_requests(sample, {})
    assert entries and all(isinstance(e, Request) for e in entries), \
        [e.message for e in entries if isinstance(e, RequestError)]


# --- one table of rules: SamplingParams and the JSONL path agree on every value ---

AGREEMENT_CASES = [
    ("temperature", 100.0), ("temperature", 200.0), ("temperature", 1e4), ("temperature", 10**400),
    ("logprobs", 20), ("logprobs", 21), ("logprobs", 10**6), ("seed", 2**64 - 1), ("seed", 2**64),
    ("seed", None), ("top_k", -1), ("top_k", 2**31), ("max_tokens", 2**31 - 1), ("max_tokens", 2**31),
    ("stop_token_ids", [2**31]), ("stop", None), ("stop", "x"), ("stop", [""]), ("n", 0),
    ("repetition_penalty", 0.0), ("min_p", 1.0), ("top_p", 0), ("ignore_eos", 1),
    ("presence_penalty", -2), ("frequency_penalty", 2.5), ("min_tokens", -1),
]


@pytest.mark.parametrize("name, value", AGREEMENT_CASES)
def test_sampling_params_and_jsonl_lines_share_one_rule_table(name, value):
    line = parse({"prompt": "a", name: value})
    try:
        SamplingParams(**{name: value})
        api_ok = True
    except ValueError as exc:
        api_ok = False
        assert f"SamplingParams.{name} " in str(exc) and len(str(exc)) < 200
    assert isinstance(line, Request) == api_ok, (line, api_ok)
    if not api_ok:
        assert f"'{name}'" in line.reason


def test_every_sampling_params_field_with_a_rule_is_accepted_per_line():
    from dataclasses import fields

    from pagedgen.engine.beam_search import BeamSearchParams
    from pagedgen.engine.sampling_params import BEAM_SEARCH_RULES, REQUEST_RULES, SAMPLING_RULES

    assert set(SAMPLING_RULES) <= {f.name for f in fields(SamplingParams)}
    assert set(BEAM_SEARCH_RULES) <= {f.name for f in fields(BeamSearchParams)}
    assert SAMPLING_FIELDS is REQUEST_RULES
