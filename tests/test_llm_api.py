"""The LLM facade: prompt forms, per-prompt params, ids, callbacks, chat, reports, bad input."""

from __future__ import annotations

import functools
import io
import sys

import pytest
from rich.console import Console

from pagedgen import LLM, RequestOutput, SamplingParams
from pagedgen.progress import GenerationProgress
from tiny_models import tiny_model_dir, tiny_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@functools.cache
def llm() -> LLM:
    return LLM(str(tiny_model_dir()), dtype="float32", num_blocks=64, max_num_seqs=8)


def ids_of(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_every_prompt_form_gives_the_same_tokens():
    text = "def hello(name):"
    token_ids = tiny_tokenizer().encode(text)
    forms = [text, [text], token_ids, [token_ids], {"prompt": text}, {"prompt_token_ids": token_ids}]
    results = [llm().generate(form, GREEDY, use_tqdm=False) for form in forms]
    assert all(len(r) == 1 for r in results)
    assert len({tuple(r[0].outputs[0].token_ids) for r in results}) == 1
    assert results[0][0].prompt == text and results[2][0].prompt is None
    assert results[0][0].prompt_token_ids == token_ids


def test_outputs_come_back_in_input_order_with_callbacks_in_finish_order():
    prompts = [[5] * 3, [6] * 4, [7] * 5]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 2, 5)]
    seen = []
    outputs = llm().generate(prompts, params, use_tqdm=False, on_output=seen.append,
                             request_ids=["a", "b", "c"])
    assert [o.request_id for o in outputs] == ["a", "b", "c"]
    assert [o.request_id for o in seen] == ["b", "c", "a"]    # shortest first
    assert [len(t) for t in ids_of(outputs)] == [9, 2, 5]
    assert all(o.finished and o.error is None for o in outputs)


def test_default_request_ids_count_up_across_calls():
    model = LLM(str(tiny_model_dir()), dtype="float32", num_blocks=16)
    first = model.generate([[1, 2], [3, 4]], GREEDY, use_tqdm=False)
    second = model.generate([5, 6], GREEDY, use_tqdm=False)
    assert [o.request_id for o in first + second] == ["0", "1", "2"]


def test_usage_counts_prompt_completion_and_cached_tokens():
    prompt = list(range(100, 140))   # 2 full blocks
    params = SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True)
    first, second = (llm().generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (40, 6)
    assert second.usage.cached_prompt_tokens == 32
    assert second.usage.total_tokens == 46
    assert [c.index for c in second.outputs] == [0, 1]


def test_chat_applies_the_template_with_the_generation_prompt():
    conversation = [{"role": "user", "content": "hi there"}]
    tokenizer = tiny_tokenizer()
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    chat = llm().chat(conversation, GREEDY, use_tqdm=False)
    plain = llm().generate([tokenizer.encode(rendered, add_special_tokens=False)], GREEDY, use_tqdm=False)
    assert ids_of(chat) == ids_of(plain)
    assert chat[0].prompt == rendered
    assert len(llm().chat([conversation, conversation], GREEDY, use_tqdm=False)) == 2


def test_memory_report_and_stats_cover_the_runs():
    llm().generate([[9] * 20], GREEDY, use_tqdm=False)
    report = llm().memory_report()
    assert report["pool"]["num_blocks"] == 64 and report["pool"]["block_size"] == 16
    assert report["summary"]["peak_blocks_used"] >= 2
    stats = llm().stats
    assert stats["generated_tokens"] > 0 and stats["steps"] > 0


def test_to_dict_is_plain_data():
    out = llm().generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=2, logprobs=1),
                         use_tqdm=False)[0]
    data = out.to_dict()
    assert data["usage"]["prompt_tokens"] == 3
    assert all(isinstance(k, str) for pos in data["outputs"][0]["logprobs"] for k in pos)


@pytest.mark.parametrize("prompts, message", [
    (42, "prompts must be"),
    ([3.5], r"prompts\[0\]"),
    ([{"text": "x"}], r"prompts\[0\] must hold"),
])
def test_bad_prompts_raise_naming_the_argument(prompts, message):
    with pytest.raises(ValueError, match=message):
        llm().generate(prompts, GREEDY, use_tqdm=False)


def test_bad_arguments_raise_naming_them():
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm().generate([[1], [2]], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="request_ids must be unique"):
        llm().generate([[1], [2]], GREEDY, use_tqdm=False, request_ids=["x", "x"])
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_model_dir()), dtype="float32", num_blocks=8, max_model_len=10_000)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_model_dir()), dtype="float32", block_size=0)


def test_an_empty_prompt_fails_alone():
    outputs = llm().generate([[], [1, 2]], GREEDY, use_tqdm=False)
    assert "prompt is empty" in outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == 5


def test_engine_options_are_checked_before_the_model_loads():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM("/nonexistent/model", max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM("/nonexistent/model", max_num_seqs=0)


def test_progress_bar_on_a_terminal_plain_lines_elsewhere(monkeypatch):
    import pagedgen.progress as progress

    terminal = io.StringIO()
    monkeypatch.setattr(progress, "stderr_console",
                        lambda: Console(file=terminal, force_terminal=True, width=160))
    llm().generate([[1, 2, 3]] * 2, GREEDY, use_tqdm=True)
    drawn = terminal.getvalue()
    assert "2/2 req" in drawn and "gen tok/s" in drawn and "prompt tok/s" in drawn and "KV" in drawn
    assert "2 requests in" in drawn and "KV peak" in drawn          # the final line
    log = io.StringIO()
    monkeypatch.setattr(progress, "stderr_console", lambda: Console(file=log, width=160))
    llm().generate([[1, 2, 3]], GREEDY, use_tqdm=True)
    assert "\x1b" not in log.getvalue() and log.getvalue().startswith("1 requests in")
    quiet = io.StringIO()
    monkeypatch.setattr(progress, "stderr_console", lambda: Console(file=quiet))
    llm().generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert quiet.getvalue() == ""
    assert llm().last_run.requests == 1 and llm().memory_report()["last_run"]["requests"] == 1


def test_an_error_mid_run_leaves_the_engine_clean_for_the_next_call():
    def explode(output: RequestOutput) -> None:
        raise OSError("disk full")

    prompts = [[1, 2, 3], [4, 5, 6] * 5, [7] * 30]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 9, 9)]
    with pytest.raises(OSError, match="disk full"):
        llm().generate(prompts, params, use_tqdm=False, on_output=explode)
    assert not llm().engine.has_unfinished()
    assert llm().engine.kv.snapshot().blocks_used == 0
    assert len(llm().generate(prompts, params, use_tqdm=False)) == 3


def test_a_failed_request_never_looks_like_an_empty_success():
    from pagedgen import RequestFailedError

    ok, failed = llm().generate([[1, 2, 3], []], GREEDY, use_tqdm=False)
    assert ok.outputs[0].token_ids and failed.error
    with pytest.raises(RequestFailedError, match="empty"):
        failed.outputs[0].text
    with pytest.raises(IndexError):         # code that caught the old IndexError still does
        failed.outputs[0]
    assert list(failed.outputs) == [] and len(failed.outputs) == 0
    assert failed.to_dict()["outputs"] == []
