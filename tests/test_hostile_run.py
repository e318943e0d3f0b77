"""`pagedgen run` under hostile paths, lines and resumes: nothing lost, nothing crashes.

Every case asserts the exit status, the error record's line and reason where there is one, that
the input's bytes are unchanged, that no other file was deleted, and that no traceback reached
the terminal.
"""

import hashlib
import json
import os
import shlex
import shutil
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

import pagedgen.jobs.prepare as prepare_module
import pagedgen.jobs.run_job as run_job
from pagedgen.cli.app import app
from tiny_models import tiny_model_dir, write_tiny_run_config
from jsonl_files import read_jsonl, write_jsonl

GOOD = {"id": "good", "prompt": "import os"}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    return write_tiny_run_config(tmp_path_factory.mktemp("config") / "tiny.yaml")


def snapshot(folder: Path) -> dict[str, str]:
    """Digest of every file under `folder`: proves nothing was deleted or changed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def run_cli(*args):
    result = CliRunner().invoke(app, ["run", *map(str, args)], catch_exceptions=False)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def kept(before: dict[str, str], after: dict[str, str]) -> bool:
    """Every file present before is still there, byte for byte."""
    return all(after.get(name) == digest for name, digest in before.items())


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the model is loaded: path problems must be found before that."""
    monkeypatch.setattr(run_job, "build_llm", lambda config: pytest.fail("model loaded"))


# --- paths: checked before anything runs ---

def test_errors_file_that_is_the_input_is_refused(tmp_path, config_path, no_model):
    inputs = write_jsonl(tmp_path / "A.jsonl", [GOOD])
    before = snapshot(tmp_path)
    result = run_cli(inputs, "-c", config_path, "--errors", inputs)
    assert result.exit_code == 2
    assert "errors file" in result.stderr and "same file as the input" in result.stderr
    assert snapshot(tmp_path) == before


def test_input_named_like_the_ordered_file_is_never_deleted(tmp_path, config_path, no_model):
    inputs = write_jsonl(tmp_path / "B.ordered.jsonl", [GOOD])
    before = snapshot(tmp_path)
    result = run_cli(inputs, "-c", config_path, "--output", tmp_path / "B.jsonl")
    assert result.exit_code == 2 and "ordered file" in result.stderr
    assert snapshot(tmp_path) == before


def test_errors_and_output_on_one_file_are_refused(tmp_path, config_path, no_model):
    inputs = write_jsonl(tmp_path / "C.jsonl", [GOOD])
    out = tmp_path / "C.out.jsonl"
    result = run_cli(inputs, "-c", config_path, "--errors", out, "--output", out)
    assert result.exit_code == 2 and "same file as the output" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("link", [os.symlink, os.link])
def test_links_to_the_input_are_resolved(tmp_path, config_path, no_model, link):
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    link(inputs, tmp_path / "alias.jsonl")
    before = snapshot(tmp_path)
    result = run_cli(inputs, "-c", config_path, "--output", tmp_path / "alias.jsonl")
    assert result.exit_code == 2 and "(after resolving links)" in result.stderr
    assert snapshot(tmp_path) == before


def test_folder_where_a_file_is_meant_and_file_where_a_folder_is(tmp_path, config_path, no_model):
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    (tmp_path / "dir.jsonl").mkdir()
    result = run_cli(inputs, "-c", config_path, "--output", tmp_path / "dir.jsonl")
    assert result.exit_code == 2 and "is a folder; give a file path" in result.stderr
    assert "--resume" not in result.stderr   # no advice that cannot work
    (tmp_path / "report").write_text("mine")
    result = run_cli(inputs, "-c", config_path, "--report-dir", tmp_path / "report")
    assert result.exit_code == 2 and "report folder" in result.stderr
    assert (tmp_path / "report").read_text() == "mine"
    result = run_cli(inputs, "-c", config_path, "--report-dir", tmp_path / "report" / "sub")
    assert result.exit_code == 2 and "cannot write the report file" in result.stderr


def test_unwritable_place_is_found_before_the_model_loads(tmp_path, config_path, no_model):
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    # /proc refuses new files even to root, unlike a chmod'ed folder.
    result = run_cli(inputs, "-c", config_path, "--errors", "/proc/self/pagedgen-errors.jsonl")
    assert result.exit_code == 2 and "cannot write the errors file" in result.stderr
    result = run_cli(inputs, "-c", config_path, "--report-dir", "/proc/self/pagedgen-report")
    assert result.exit_code == 2 and "cannot write the report file" in result.stderr
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        result = run_cli(inputs, "-c", config_path, "--output", locked / "out.jsonl")
        assert result.exit_code == 2 and "cannot write the output" in result.stderr


def test_a_file_pagedgen_did_not_write_is_never_touched(tmp_path, config_path, no_model):
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    theirs = tmp_path / "in.completions.errors.jsonl"
    theirs.write_text("the user's own notes\n")
    before = snapshot(tmp_path)
    for flags in ([], ["--overwrite"], ["--resume"]):
        result = run_cli(inputs, "-c", config_path, *flags)
        assert result.exit_code == 2 and "no run manifest" in result.stderr
        assert snapshot(tmp_path) == before


def test_only_files_the_manifest_lists_are_replaced(tmp_path, config_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD, {"id": "bad", "prompt": ""}])
    first = run_cli(inputs, "-c", config_path, "--no-report")
    assert first.exit_code == 1
    manifest = json.loads((tmp_path / "in.completions.manifest.json").read_text())
    assert os.path.realpath(tmp_path / "in.completions.errors.jsonl") in manifest["files"]
    assert os.path.realpath(inputs) not in manifest["files"]
    (tmp_path / "unrelated.txt").write_text("keep me")
    before = snapshot(tmp_path)
    again = run_cli(inputs, "-c", config_path, "--no-report", "--overwrite")
    assert again.exit_code == 1
    after = snapshot(tmp_path)
    assert after["in.jsonl"] == before["in.jsonl"] and after["unrelated.txt"] == before["unrelated.txt"]
    assert len(read_jsonl(tmp_path / "in.completions.jsonl")) == 1


# --- one line never ends the run ---

@pytest.fixture(scope="module")
def raising_template_model(tmp_path_factory) -> Path:
    """The tiny model with a Llama-2-style template that raises on a conversation opened by
    the assistant (raise_exception, as in Mistral and Llama-2 templates)."""
    folder = tmp_path_factory.mktemp("model") / "raising"
    shutil.copytree(tiny_model_dir("llama"), folder)
    template = folder / "chat_template.jinja"
    template.write_text("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception("
                        "'Conversation roles must alternate user/assistant') }}{% endif %}"
                        + template.read_text())
    return folder


HOSTILE_LINES = [
    # (line, fragment of the error reason; None = the line runs)
    (GOOD, None),
    (b'{"id": "sur", "prompt": "a\\ud800b"}', "lone surrogate"),
    (b'{"id": "\\ud800", "prompt": "x"}', "lone surrogate"),
    (b'{"prompt": "x", "stop": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested deeper than 64"),
    (b"[" * 1000 + b"]" * 1000, "nested deeper than 64"),
    (b"[" * 30000 + b"]" * 30000, "nested deeper than 64"),
    ({"id": "seed64", "prompt": "x", "seed": 2**64}, "'seed' must be an integer in [0, 2**64 - 1]"),
    ({"id": "seedmax", "prompt": "x", "seed": 2**64 - 1}, None),
    (b'{"id": "digits", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}", "too many digits"),
    (b'{"id": "inf", "prompt": "x", "temperature": 1e400}', "'temperature' must be a number"),
    ({"id": "big-n", "prompt": "x", "n": 100}, "more than max_num_seqs (4)"),
    ({"id": "logprobs", "prompt": "x", "logprobs": 10**6}, "'logprobs' must be an integer in [0, 20]"),
    ({"id": "topk", "prompt": "x", "top_k": 2**40}, "'top_k' must be an integer"),
    ({"id": "raise", "messages": [{"role": "assistant", "content": "hi"}]},
     "the chat template failed: TemplateError: Conversation roles must alternate"),
    ({"id": "chat", "messages": [{"role": "user", "content": "hi"}]}, None),
    (b"\xff\xfe not utf-8", "invalid UTF-8"),
    ({"id": "long", "prompt": "y" * 100_000}, "longer than the limit of 65536 bytes"),
    ({"id": "huge-id-" + "z" * 5000, "prompt": "x"}, None),
]


def test_one_line_never_ends_the_run(tmp_path, config_path, raising_template_model):
    inputs = write_jsonl(tmp_path / "in.jsonl", [line for line, _ in HOSTILE_LINES])
    digest = hashlib.sha256(inputs.read_bytes()).hexdigest()
    result = run_cli(inputs, "-c", config_path, "--model", raising_template_model, "--no-report")
    assert result.exit_code == 1, result.stderr
    errors = {e["line"]: e["error"]["message"] for e in read_jsonl(tmp_path / "in.completions.errors.jsonl")}
    answered = {r["line"] for r in read_jsonl(tmp_path / "in.completions.jsonl")}
    for number, (_, fragment) in enumerate(HOSTILE_LINES, start=1):
        if fragment is None:
            assert number in answered and number not in errors, (number, errors.get(number))
        else:
            assert fragment in errors.get(number, ""), (number, errors.get(number))
            assert len(errors[number]) < 400      # no unbounded value copied into the message
    ordered = read_jsonl(tmp_path / "in.completions.ordered.jsonl")
    assert [r["line"] for r in ordered] == list(range(1, len(HOSTILE_LINES) + 1))
    assert hashlib.sha256(inputs.read_bytes()).hexdigest() == digest


def test_line_byte_limit_is_configurable(tmp_path, config_path, monkeypatch):
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD, {"id": "wide", "prompt": "q" * 500}])
    calls = []
    real = prepare_module.prompt_token_ids
    monkeypatch.setattr(prepare_module, "prompt_token_ids", lambda r, t: calls.append(r.id) or real(r, t))
    result = run_cli(inputs, "-c", config_path, "--max-line-bytes", "200", "--no-report")
    assert result.exit_code == 1
    [error] = read_jsonl(tmp_path / "in.completions.errors.jsonl")
    assert error["line"] == 2 and "longer than the limit of 200 bytes" in error["error"]["message"]
    assert calls == ["good"]   # the long line was never tokenized


def test_long_line_is_refused_before_tokenizing_with_the_default_limit(tmp_path, monkeypatch):
    """No max_model_len configured: the line is read (the model's length is not known yet), but
    once the model says what fits, a line over 32 bytes a token is refused untokenized."""
    config = tmp_path / "no-len.yaml"
    config.write_text(f"model: {tiny_model_dir('llama')}\ndtype: float32\ndevice: cpu\n"
                      "num_blocks: 64\nmax_num_seqs: 4\nthreads: 1\n"
                      "sampling:\n  max_tokens: 2\n  temperature: 0\n")
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD, {"id": "50k-tokens", "prompt": "word " * 40_000}])
    calls = []
    real = prepare_module.prompt_token_ids
    monkeypatch.setattr(prepare_module, "prompt_token_ids", lambda r, t: calls.append(r.id) or real(r, t))
    result = run_cli(inputs, "-c", config, "--no-report")
    assert result.exit_code == 1
    [error] = read_jsonl(tmp_path / "in.completions.errors.jsonl")
    assert error["line"] == 2 and "longer than the limit of 65536 bytes" in error["error"]["message"]
    assert calls == ["good"]


def test_a_failing_request_is_its_own_error(tmp_path, config_path, monkeypatch):
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD, {"id": "other", "prompt": "x = 1"}])
    real = run_job.to_result

    def fail_for_other(item, output, model_name, tokenizer):
        if item.request.id == "other":
            raise RuntimeError("decoding exploded")
        return real(item, output, model_name, tokenizer)
    monkeypatch.setattr(run_job, "to_result", fail_for_other)
    result = run_cli(inputs, "-c", config_path, "--no-report")
    assert result.exit_code == 1
    [error] = read_jsonl(tmp_path / "in.completions.errors.jsonl")
    assert error["line"] == 2 and "RuntimeError: decoding exploded" in error["error"]["message"]
    assert [r["id"] for r in read_jsonl(tmp_path / "in.completions.jsonl")] == ["good"]


def test_a_fault_of_the_whole_run_is_exit_3_with_a_log(tmp_path, config_path, monkeypatch):
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    monkeypatch.setattr(run_job, "write_ordered", lambda *a: (_ for _ in ()).throw(RuntimeError("disk on fire")))
    result = run_cli(inputs, "-c", config_path, "--no-report")
    assert result.exit_code == 3
    log = tmp_path / "in.completions.error.log"
    assert f"internal error: RuntimeError: disk on fire; the traceback is in {log}" in result.stderr
    assert "Traceback" in log.read_text() and "disk on fire" in log.read_text()
    assert len(read_jsonl(tmp_path / "in.completions.jsonl")) == 1   # finished work kept
    debug = CliRunner().invoke(app, ["run", str(inputs), "-c", str(config_path), "--no-report",
                                     "--overwrite", "--debug"])
    assert debug.exit_code == 3 and "Traceback" in debug.stderr


# --- config bounds ---

def test_default_n_above_max_num_seqs_is_a_config_error(tmp_path, config_path, no_model):
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    result = run_cli(inputs, "-c", config_path, "--n", "100", "--max-num-seqs", "8")
    assert result.exit_code == 2 and "'n' is 100, more than max_num_seqs (8)" in result.stderr


def test_yaml_alias_bomb_is_refused_at_once(tmp_path, no_model):
    inputs = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    bomb = tmp_path / "bomb.yaml"
    rows = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    rows += [f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]"
             for i in range(8)]
    bomb.write_text("\n".join(rows) + "\nsampling:\n  stop: *i\n")
    result = run_cli(inputs, "-c", bomb)
    assert result.exit_code == 2 and "anchors and aliases" in result.stderr
    long_value = tmp_path / "long.yaml"
    long_value.write_text("sampling:\n  max_tokens: '" + "9" * 500_000 + "'\n")
    result = run_cli(inputs, "-c", long_value)
    assert result.exit_code == 2 and len(result.stderr) < 500


# --- resume: the manifest decides ---

def interrupt_after(monkeypatch, count: int) -> None:
    real, seen = run_job.result_record, []

    def record_then_sigint(result):
        seen.append(result)
        if len(seen) == count:
            os.kill(os.getpid(), signal.SIGINT)
        return real(result)
    monkeypatch.setattr(run_job, "result_record", record_then_sigint)


def test_resume_refuses_other_models_and_settings_and_then_completes_exactly(
        tmp_path, config_path, monkeypatch):
    ids = [f"r{i}" for i in range(6)]
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"x = {n}"} for n, i in enumerate(ids)])
    reference = tmp_path / "reference.jsonl"
    assert run_cli(inputs, "-c", config_path, "--no-report", "--output", reference).exit_code == 0

    command = [inputs, "--config", config_path, "--no-report", "--max-num-seqs", "1", "--set", "seed=3",
               "--dtype", "float32", "--temperature", "0"]
    interrupt_after(monkeypatch, 2)
    first = run_cli(*command)
    monkeypatch.undo()
    assert first.exit_code == 130
    hint = shlex.join(["pagedgen", "run", *map(str, command), "--resume"])
    assert f"Resume with: {hint}" in first.stderr
    output = tmp_path / "in.completions.jsonl"
    partial = output.read_bytes()

    other_model = tiny_model_dir("qwen2")
    refused = [
        (["--model", other_model], ["model:", "model_files:"]),
        (["--temperature", "0.5", "--set", "seed=4"], ["sampling.temperature: 0.0 -> 0.5", "seed: 3 -> 4"]),
        (["--dtype", "bfloat16", "--block-size", "8"], ["dtype: 'float32' -> 'bfloat16'", "block_size: 16 -> 8"]),
    ]
    for extra, fields in refused:
        result = run_cli(*command, *extra, "--resume")
        assert result.exit_code == 2, result.stderr
        assert f"Resume with the same settings ({hint})" in result.stderr
        for name in fields:
            assert name in result.stderr, (name, result.stderr)
        assert output.read_bytes() == partial

    resumed = run_cli(*command, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    done = read_jsonl(output)
    assert sorted(r["id"] for r in done) == ids
    expected = {r["id"]: r["outputs"] for r in read_jsonl(reference)}
    assert all(r["outputs"] == expected[r["id"]] for r in done)

    inputs.write_bytes(inputs.read_bytes() + b'{"id": "new", "prompt": "y"}\n')
    changed = run_cli(*command, "--resume")
    assert changed.exit_code == 2 and "input_sha256" in changed.stderr


def test_exit_codes_are_in_the_help():
    result = CliRunner().invoke(app, ["run", "--help"])
    text = " ".join(result.output.split())
    for fragment in ("0 every request answered", "1 some lines failed", "2 usage, config, path",
                     "3 internal error", "130 / 143 interrupted"):
        assert fragment in text
