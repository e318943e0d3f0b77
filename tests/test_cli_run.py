"""`pagedgen run` end to end through the CLI on a tiny random model (tests/tiny_models.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import pagedgen.jobs.run_job as run_job
from pagedgen.cli.app import app
from tiny_models import tiny_hf_model, tiny_model_dir, tiny_tokenizer
from interrupts import signal_after_results
from jsonl_files import read_jsonl, write_jsonl

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    """Greedy float32 on CPU, a small pool and short completions."""
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    path.write_text(f"model: {tiny_model_dir('llama')}\ndtype: float32\ndevice: cpu\n"
                    "num_blocks: 64\nmax_num_seqs: 4\nmax_model_len: 64\nthreads: 1\n"
                    "sampling:\n  max_tokens: 4\n  temperature: 0\n  ignore_eos: true\n"
                    "output:\n  ordered: true\n")
    return path


def run_cli(*args: str):
    return CliRunner().invoke(app, ["run", *map(str, args)], catch_exceptions=False)


def key(record: dict) -> str:
    return str(record.get("custom_id", record.get("id")))


def test_every_input_kind_and_the_openai_format(tmp_path, config_path):
    prompt_ids = tiny_tokenizer().encode("def main():")
    inputs = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "text", "prompt": "import os"},
        {"id": "chat", "messages": [{"role": "user", "content": "Hello"}]},
        {"id": "ids", "prompt_token_ids": prompt_ids, "max_tokens": 6},
        {"custom_id": "oa-chat", "method": "POST", "url": CHAT,
         "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}],
                  "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "oa-text", "method": "POST", "url": COMPLETIONS,
         "body": {"model": "x", "prompt": "class A:", "max_tokens": 2}},
    ])
    result = run_cli(inputs, "--config", config_path, "--no-report")
    assert result.exit_code == 0, result.output
    output = tmp_path / "in.completions.jsonl"
    records = {key(r): r for r in read_jsonl(output)}
    assert set(records) == {"text", "chat", "ids", "oa-chat", "oa-text"}

    # Greedy token ids equal transformers' generate on the same weights (the oracle).
    expected = tiny_hf_model("llama").generate(torch.tensor([prompt_ids]), max_new_tokens=6,
                                               do_sample=False)[0, len(prompt_ids):].tolist()
    sample = records["ids"]["outputs"][0]
    assert sample["token_ids"] == expected and sample["finish_reason"] == "length"
    assert sample["text"] == tiny_tokenizer().decode(expected, skip_special_tokens=True)
    assert records["ids"]["usage"]["prompt_tokens"] == len(prompt_ids)

    chat_ids = tiny_tokenizer().apply_chat_template([{"role": "user", "content": "Hello"}],
                                                    add_generation_prompt=True, tokenize=False)
    assert records["chat"]["usage"]["prompt_tokens"] == len(tiny_tokenizer().encode(chat_ids))

    oa = records["oa-chat"]
    assert oa["error"] is None and oa["response"]["status_code"] == 200
    body = oa["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
    assert len(body["choices"][0]["logprobs"]["content"]) == 3
    assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    text_body = records["oa-text"]["response"]["body"]
    assert text_body["object"] == "text_completion" and text_body["usage"]["completion_tokens"] == 2

    ordered = read_jsonl(tmp_path / "in.completions.ordered.jsonl")
    assert [key(r) for r in ordered] == ["text", "chat", "ids", "oa-chat", "oa-text"]
    assert not (tmp_path / "in.completions.errors.jsonl").exists()


def test_per_request_values_override_config_and_flags(tmp_path, config_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "default", "prompt": "x = 1"},
        {"id": "short", "prompt": "x = 1", "max_tokens": 1},
        {"id": "three", "prompt": "x = 1", "n": 3, "temperature": 1.0, "seed": 5},
    ])
    out = tmp_path / "out.jsonl"
    result = run_cli(inputs, "-c", config_path, "-o", out, "--max-tokens", 2, "--no-report")
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in read_jsonl(out)}
    assert [len(o["token_ids"]) for o in records["default"]["outputs"]] == [2]  # flag beats YAML
    assert [len(o["token_ids"]) for o in records["short"]["outputs"]] == [1]    # line beats flag
    assert sorted(o["index"] for o in records["three"]["outputs"]) == [0, 1, 2]
    assert records["three"]["usage"]["completion_tokens"] == 6


def test_bad_lines_get_errors_with_line_numbers_and_good_lines_run(tmp_path, config_path):
    long_prompt = list(range(5, 75))  # 70 tokens > max_model_len 64
    inputs = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "ok1", "prompt": "print(1)"},
        b'{"id": "broken", "prompt": ',
        {"id": "noprompt", "max_tokens": 3},
        {"id": "wrongtype", "prompt": ["a"]},
        {"id": "badvalue", "prompt": "a", "top_p": 2},
        {"id": "toolong", "prompt_token_ids": long_prompt},
        {"id": "ok1", "prompt": "again"},
        b'{"id": "utf", "prompt": "\xc3\x28"}',
        {"id": "vocab", "prompt_token_ids": [1, 10**6]},
        {"custom_id": "oa-bad", "method": "POST", "url": CHAT, "body": {"messages": []}},
        {"id": "ok2", "prompt_token_ids": [7, 8, 9]},
    ])
    result = run_cli(inputs, "-c", config_path, "--no-report")
    assert result.exit_code == 1, result.output
    answered = [key(r) for r in read_jsonl(tmp_path / "in.completions.jsonl")]
    assert sorted(answered) == ["ok1", "ok2"]
    errors = {e["line"] if "line" in e else e["error"]["line"]: e
              for e in read_jsonl(tmp_path / "in.completions.errors.jsonl")}
    expected = {2: "invalid JSON", 3: "needs exactly one of", 4: "'prompt' must be a non-empty string",
                5: "'top_p' must be a number", 6: "prompt is 70 tokens; max_model_len is 64",
                7: "duplicate id 'ok1' (first used on line 1)", 8: "invalid UTF-8",
                9: "outside the vocabulary", 10: "'messages' must be a non-empty list"}
    assert sorted(errors) == sorted(expected)
    for line, fragment in expected.items():
        message = errors[line]["error"]["message"]
        assert message.startswith(f"line {line}: ") and fragment in message, message
    assert errors[10]["custom_id"] == "oa-bad" and errors[10]["response"] is None
    ordered = read_jsonl(tmp_path / "in.completions.ordered.jsonl")
    assert len(ordered) == 11 and [key(r) for r in ordered][:2] == ["ok1", "None"]
    assert "2 failed" not in result.stderr and "9 failed" in result.stderr


def test_usage_and_config_errors_exit_2_before_running(tmp_path, config_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text("blok_size: 16\n")
    result = run_cli(inputs, "-c", bad_config)
    assert result.exit_code == 2
    assert f"{bad_config}: unknown key 'blok_size' (did you mean 'block_size'?)" in result.stderr
    assert run_cli(inputs, "-c", config_path, "--block-size", 0).exit_code == 2
    assert run_cli(tmp_path / "missing.jsonl", "-c", config_path).exit_code == 2
    missing_model = run_cli(inputs, "-c", config_path, "--model", tmp_path / "nowhere", "--no-report")
    assert missing_model.exit_code == 2 and "cannot load the model" in missing_model.stderr
    # A model that cannot load is found before anything is written: no manifest is left.
    assert not (tmp_path / "in.completions.manifest.json").exists()
    both = run_cli(inputs, "-c", config_path, "--resume", "--overwrite")
    assert both.exit_code == 2 and "contradict" in both.stderr
    if not torch.cuda.is_available():
        no_gpu = run_cli(inputs, "-c", config_path, "--device", "cuda", "--no-report")
        assert no_gpu.exit_code == 2 and "CUDA is not available" in no_gpu.stderr
    assert run_cli(inputs, "-c", config_path, "--no-report").exit_code == 0
    exists = run_cli(inputs, "-c", config_path, "--no-report")
    assert exists.exit_code == 2 and "--resume" in exists.stderr and "--overwrite" in exists.stderr
    assert not list(tmp_path.glob("*.errors.jsonl"))


def test_interrupted_run_resumes_and_answers_every_id_once(tmp_path, config_path, monkeypatch):
    ids = [f"r{i}" for i in range(8)]
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"x = {n}"} for n, i in enumerate(ids)])
    real_record = signal_after_results(monkeypatch, 3, signal.SIGTERM)  # mid-write
    first = run_cli(inputs, "-c", config_path, "--max-num-seqs", 1, "--no-report")
    assert first.exit_code == 128 + signal.SIGTERM
    assert "Interrupted by SIGTERM: 3 of 8 requests done" in first.stderr
    assert "--resume" in first.stderr
    output = tmp_path / "in.completions.jsonl"
    assert output.read_bytes().endswith(b"\n") and len(read_jsonl(output)) == 3
    assert not (tmp_path / "in.completions.ordered.jsonl").exists()

    monkeypatch.setattr(run_job, "result_record", real_record)
    with output.open("ab") as handle:  # a line cut off by a hard kill
        handle.write(b'{"id": "r7", "outputs": [{"index": 0, "te')
    second = run_cli(inputs, "-c", config_path, "--resume", "--no-report")
    assert second.exit_code == 0, second.output
    assert "8 of 8 requests answered (3 from an earlier run)" in second.stderr
    assert sorted(key(r) for r in read_jsonl(output)) == ids
    assert [key(r) for r in read_jsonl(tmp_path / "in.completions.ordered.jsonl")] == ids

    # Nothing left to do: the model is not even loaded, and the result stays the same.
    monkeypatch.setattr(run_job, "build_llm", lambda config: pytest.fail("model loaded"))
    third = run_cli(inputs, "-c", config_path, "--resume", "--no-report")
    assert third.exit_code == 0 and len(read_jsonl(output)) == 8


def test_ctrl_c_after_the_job_ends_exits_130_not_some_lines_failed(tmp_path, config_path,
                                                                    monkeypatch):
    # Outside the job's own handlers a SIGINT reaches Typer as a KeyboardInterrupt: it must
    # still exit 130 (interrupted), never 1, which says "some lines failed".
    import pagedgen.cli.app as cli_app

    inputs = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x = 1"}])

    def interrupted_while_printing(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_app, "_print_outcome", interrupted_while_printing)
    with pytest.raises(SystemExit) as exit_:
        cli_app.app(["run", str(inputs), "-c", str(config_path), "--no-report", "-q"],
                    prog_name="pagedgen")
    assert exit_.value.code == 128 + signal.SIGINT
    assert [key(r) for r in read_jsonl(tmp_path / "in.completions.jsonl")] == ["a"]


def test_sigterm_to_a_real_process_leaves_whole_lines(tmp_path, config_path):
    """A separate process killed by SIGTERM mid-run: clean stop, then --resume completes it."""
    count = 30
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"y = {i}", "max_tokens": 40}
                                                 for i in range(count)])
    output = tmp_path / "in.completions.jsonl"
    command = [sys.executable, "-m", "pagedgen", "run", str(inputs),
               "-c", str(config_path), "--max-num-seqs", "1", "--no-report", "-q"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while not (output.exists() and output.read_bytes().count(b"\n") >= 2):
        assert process.poll() is None and time.monotonic() < deadline, "run ended before the signal"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, stderr.decode()
    done = read_jsonl(output)  # every line parses: no partial record
    assert output.read_bytes().endswith(b"\n") and 2 <= len(done) < count
    assert f"{len(done)} of {count} requests done" in " ".join(stderr.decode().split())

    resumed = run_cli(inputs, "-c", config_path, "--resume", "--no-report")
    assert resumed.exit_code == 0, resumed.output
    assert sorted(r["id"] for r in read_jsonl(output)) == list(range(count))


def test_memory_report_is_written_next_to_the_output(tmp_path, config_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a = [", "n": 2}, {"prompt": "a = ["}])
    result = run_cli(inputs, "-c", config_path)
    assert result.exit_code == 0, result.output
    report_dir = tmp_path / "in.completions.report"
    report = json.loads((report_dir / "memory_report.json").read_text())
    assert report["pool"]["num_blocks"] == 64 and report["timeline"]
    assert (report_dir / "memory_timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert str(report_dir / "memory_report.json") in result.stderr
    assert "KV pool" in result.stderr  # the terminal summary


def test_summary_names_only_files_that_exist(tmp_path, config_path):
    # Every line fails before generation: no model is loaded and no completions file is made.
    inputs = write_jsonl(tmp_path / "bad.jsonl", [
        {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"messages": [], "stream": True}},
        {"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ])
    output = tmp_path / "out" / "x.jsonl"
    result = run_cli(inputs, "-c", config_path, "-q", "--output", output)
    assert result.exit_code == 1, result.output
    assert not output.exists()
    assert "completions:" not in result.stderr and str(output) + "\n" not in result.stderr
    errors, ordered = tmp_path / "out" / "x.errors.jsonl", tmp_path / "out" / "x.ordered.jsonl"
    assert f"errors:      {errors}" in result.stderr and len(read_jsonl(errors)) == 2
    assert f"in order:    {ordered}" in result.stderr and len(read_jsonl(ordered)) == 2
    assert "report:" not in result.stderr


def test_plain_text_lines_say_why_and_how_to_wrap_them(tmp_path, config_path):
    source = tmp_path / "plain.jsonl"
    source.write_text("Tell me a joke.\nWhat is the capital of France?\n")
    result = run_cli(source, "--config", config_path, "--output", tmp_path / "out.jsonl", "-q")
    assert result.exit_code == 1
    assert "0 of 2 requests answered, 2 failed" in result.output
    assert "line 1: plain text, not JSON" in result.output
    assert 'write the line as {"prompt": "your text"}' in result.output


def test_version():
    from pagedgen import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"pagedgen {__version__}"
