"""The Python API as a hostile (or hurried) user drives it: threads, numpy, dicts, a string as a
chat, keys the CLI refuses, schemas no output can satisfy. The API follows the CLI's rules."""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pagedgen import LLM, SamplingParams
from pagedgen.cli.app import app
from jsonl_files import read_jsonl, write_jsonl
from tiny_models import tiny_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@functools.cache
def llm() -> LLM:
    return LLM(str(tiny_model_dir()), dtype="float32", num_blocks=64, max_num_seqs=4,
               max_model_len=64, threads=1)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# --- threads ---

def test_threads_sharing_one_llm_each_get_their_own_answers():
    prompts = {t: [[3 + t, 4 + i, 5] for i in range(3)] for t in range(4)}
    expected = {t: tokens(llm().generate(p, GREEDY, use_tqdm=False)) for t, p in prompts.items()}
    got, failures = {}, []
    start = threading.Barrier(len(prompts))

    def worker(t: int) -> None:
        try:
            start.wait()
            got[t] = tokens(llm().generate(prompts[t], GREEDY, use_tqdm=False))
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(repr(exc))
    threads = [threading.Thread(target=worker, args=(t,)) for t in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and got == expected


# --- token ids from numpy, sampling params from a dict ---

def test_numpy_arrays_and_numpy_integers_are_token_ids():
    ids = [7, 8, 9, 10]
    want = tokens(llm().generate([ids], GREEDY, use_tqdm=False))
    for form in (np.array(ids), [np.int64(t) for t in ids], np.array(ids, dtype=np.int32),
                 {"prompt_token_ids": np.array(ids)}):
        assert tokens(llm().generate(form, GREEDY, use_tqdm=False)) == want, type(form)
    two = llm().generate([np.array(ids), np.array(ids[:2])], GREEDY, use_tqdm=False)
    assert len(two) == 2 and tokens(two)[0] == want[0]
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        llm().generate([np.array([1.5, 2.0])], GREEDY, use_tqdm=False)   # floats are not ids


def test_a_dict_is_taken_as_sampling_params_and_a_bad_key_is_named():
    as_dict = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    want = tokens(llm().generate(["a = 1"], GREEDY, use_tqdm=False))
    assert tokens(llm().generate(["a = 1"], as_dict, use_tqdm=False)) == want
    assert tokens(llm().generate(["a = 1"], [as_dict], use_tqdm=False)) == want
    with pytest.raises(ValueError, match="temprature"):
        llm().generate(["a = 1"], {"temprature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm().generate(["a = 1"], "greedy", use_tqdm=False)


# --- chat: the expected shape, and the CLI's rules ---

def test_chat_of_a_string_is_refused_with_the_shape_expected():
    for wrong in ("hi", ["hi", "yo"], []):
        with pytest.raises(ValueError, match=r"chat\(\) takes a conversation"):
            llm().chat(wrong, GREEDY, use_tqdm=False)


def cli_reason(tmp_path: Path, line: dict) -> str:
    """The reason `pagedgen run` gives for this line."""
    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {tiny_model_dir()}\ndtype: float32\nnum_blocks: 32\nmax_model_len: 64\n")
    inputs = write_jsonl(tmp_path / "in.jsonl", [line])
    result = CliRunner().invoke(app, ["run", str(inputs), "-c", str(config), "--no-report"])
    assert result.exit_code == 1, result.output
    errors = read_jsonl(tmp_path / "in.completions.errors.jsonl")
    return errors[0]["error"]["message"] if "error" in errors[0] else \
        errors[0]["response"]["body"]["error"]["message"]


@pytest.mark.parametrize("messages,reason", [
    ([{"content": "x"}], "messages[0] needs a string 'role' and a 'content'"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list of text parts"),
    ([{"role": "tool", "content": "x", "tool_call_id": "c1"}], "messages[0] has unknown key 'tool_call_id'"),
])
def test_a_conversation_the_cli_refuses_the_api_refuses_alike(tmp_path, messages, reason):
    with pytest.raises(ValueError) as refused:
        llm().chat(messages, GREEDY, use_tqdm=False)
    assert reason in str(refused.value)
    assert reason in cli_reason(tmp_path, {"messages": messages})


def test_an_openai_tool_message_names_its_extra_key(tmp_path):
    line = {"custom_id": "t", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"},
                                  {"role": "tool", "content": "42", "tool_call_id": "c1"}]}}
    assert "messages[1] has unknown key 'tool_call_id'" in cli_reason(tmp_path, line)


def test_a_prompt_dict_with_a_key_the_cli_refuses_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown key 'max_token'"):
        llm().generate({"prompt": "x", "max_token": 3}, GREEDY, use_tqdm=False)
    assert "unknown key 'max_token'" in cli_reason(tmp_path, {"prompt": "x", "max_token": 3})


# --- structured outputs ---

def test_structured_output_errors_say_got_once():
    with pytest.raises(ValueError) as bad:
        SamplingParams(structured_outputs={"json": 5})
    assert str(bad.value).count("got") == 1
    from pagedgen.engine.sampling_params import check_field

    with pytest.raises(ValueError) as bad:
        check_field("structured_outputs", {"json": 5})
    assert str(bad.value).count("got") == 1, str(bad.value)


def test_a_schema_with_no_first_token_is_an_invalid_request_not_an_empty_success(tmp_path):
    pytest.importorskip("llguidance")
    never = SamplingParams(temperature=0, max_tokens=6, structured_outputs={"json": {"$ref": "#"}})
    ok, refused = llm().generate(["a", "b"], [GREEDY, never], use_tqdm=False)
    assert ok.error is None and refused.outputs == []
    assert "no output can ever satisfy it" in refused.error
    line = {"prompt": "a", "max_tokens": 6, "structured_outputs": {"json": {"$ref": "#"}}}
    assert "invalid structured_outputs.json: no output can ever satisfy it" in cli_reason(tmp_path, line)


def test_a_schema_that_can_start_but_never_end_finishes_by_length():
    pytest.importorskip("llguidance")
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs={"json": endless},
                            seed=0)
    out = llm().generate(["a"], params, use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text.startswith("{")
