"""`pagedgen run` with structured_outputs / response_format and prompt_logprobs lines."""

import json
import re
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from tiny_models import tiny_model_dir

CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    path.write_text(f"model: {tiny_model_dir('llama')}\ndtype: float32\ndevice: cpu\n"
                    "num_blocks: 64\nmax_num_seqs: 4\nmax_model_len: 128\nthreads: 1\n"
                    "sampling:\n  max_tokens: 60\n  temperature: 1.0\n"
                    "output:\n  ordered: true\n")
    return path


def run(tmp_path: Path, config_path: Path, lines: list[dict]) -> tuple[dict, dict]:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    CliRunner().invoke(app, ["run", str(inputs), "-o", str(out), "--config", str(config_path)],
                       catch_exceptions=False)
    results = {str(r.get("custom_id", r.get("id"))): r for r in map(json.loads, out.read_text().splitlines())}
    errors_path = tmp_path / "out.errors.jsonl"
    errors = {} if not errors_path.exists() else {
        str(r.get("custom_id", r.get("id"))): r for r in map(json.loads, errors_path.read_text().splitlines())}
    return results, errors


def batch_line(custom_id: str, response_format: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": "Classify: buy now!"}],
                     "response_format": response_format}}


def test_constrained_lines_and_openai_response_formats(tmp_path, config_path):
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    results, errors = run(tmp_path, config_path, [
        {"id": "json", "prompt": "Classify: buy now!", "structured_outputs": compact, "n": 3},
        {"id": "regex", "prompt": "Code:", "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{3}"}},
        {"id": "choice", "prompt": "Sentiment:", "structured_outputs": {"choice": ["pos", "neg"]}},
        {"id": "bad-schema", "prompt": "x", "structured_outputs": {"json": {"type": "nope"}}},
        {"id": "two-kinds", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
        batch_line("oa-schema", {"type": "json_schema", "json_schema": {
            "name": "label", "schema": SCHEMA, "strict": True}}),
        batch_line("oa-object", {"type": "json_object"}),
        batch_line("oa-bad", {"type": "xml"}),
    ])
    for sample in results["json"]["outputs"]:
        jsonschema.validate(json.loads(sample["text"]), SCHEMA)
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", results["regex"]["outputs"][0]["text"])
    assert results["choice"]["outputs"][0]["text"] in ("pos", "neg")
    schema_choice = results["oa-schema"]["response"]["body"]["choices"][0]
    if schema_choice["finish_reason"] == "stop":   # free whitespace may run into max_tokens
        jsonschema.validate(json.loads(schema_choice["message"]["content"]), SCHEMA)
    assert schema_choice["message"]["content"].lstrip().startswith("{")
    assert results["oa-object"]["response"]["body"]["choices"][0]["message"]["content"].lstrip()[0] == "{"
    assert "invalid structured_outputs.json" in errors["bad-schema"]["error"]["message"]
    assert errors["bad-schema"]["error"]["code"] == "invalid_request"
    assert "exactly one of" in errors["two-kinds"]["error"]["message"]
    assert "response_format" in errors["oa-bad"]["error"]["message"]
    assert set(results) | set(errors) == {"json", "regex", "choice", "bad-schema", "two-kinds",
                                          "oa-schema", "oa-object", "oa-bad"}


def test_prompt_logprobs_are_in_the_record(tmp_path, config_path):
    results, _ = run(tmp_path, config_path, [
        {"id": "p", "prompt": "def wrap(text):", "prompt_logprobs": 2, "max_tokens": 1},
        {"custom_id": "oa", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "import os", "prompt_logprobs": 1, "max_tokens": 1}},
    ])
    positions = results["p"]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == results["p"]["usage"]["prompt_tokens"]
    for entry in positions[1:]:
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[:2] == [1, 2] and all(v["logprob"] <= 0 for v in entry.values())
        best = min(entry.values(), key=lambda v: v["rank"])
        assert best["logprob"] == max(v["logprob"] for v in entry.values())
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    body = results["oa"]["response"]["body"]
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 1
