"""The Python API under bad requests: one that fails alone comes back with `error` set while
the others complete; a call that cannot queue all its requests leaves none of them queued."""

from __future__ import annotations

import functools

import pytest

from pagedgen import LLM, SamplingParams
from tiny_models import tiny_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
RAISING_TEMPLATE = (  # Mistral / Llama-2 style: a system message is refused by the template
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.cache
def llm() -> LLM:
    return LLM(str(tiny_model_dir()), dtype="float32", num_blocks=32, max_num_seqs=4,
               max_model_len=64)


def alone(prompt) -> list[int]:
    return llm().generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_huge_logprobs_fails_alone_or_is_refused_at_construction():
    try:
        bad = SamplingParams(logprobs=10**6, max_tokens=4)
    except ValueError as error:   # SamplingParams validates with the JSONL path's rules
        assert "logprobs" in str(error)
        return
    outputs = llm().generate(["hello", "bye"], [GREEDY, bad], use_tqdm=False)
    assert outputs[0].error is None and outputs[0].outputs[0].token_ids == alone("hello")
    assert outputs[1].error is not None and "logprobs=1000000" in outputs[1].error
    assert outputs[1].outputs == []


@pytest.mark.parametrize("bad,reason", [
    ("a\ud800b", "lone surrogate '\\ud800' at character 1"),
    ([9] * 80, "max_model_len is 64"),               # longer than the model length
    ([3, 10**6], "prompt token ids must be in [0, 512)"),
    ([], "prompt is empty"),
])
def test_a_request_the_engine_cannot_serve_fails_alone(bad, reason):
    seen = []
    outputs = llm().generate(["hello", bad, "bye"], GREEDY, use_tqdm=False, on_output=seen.append,
                             request_ids=["good-1", "bad", "good-2"])
    assert [o.request_id for o in outputs] == ["good-1", "bad", "good-2"]
    assert outputs[1].finished and outputs[1].error.startswith("request 'bad': ")
    assert reason in outputs[1].error
    assert [o.outputs[0].token_ids for o in (outputs[0], outputs[2])] == [alone("hello"), alone("bye")]
    assert sorted(o.request_id for o in seen) == ["bad", "good-1", "good-2"]


def test_a_chat_template_that_raises_fails_its_conversation_alone():
    model = LLM(str(tiny_model_dir()), dtype="float32", num_blocks=32, max_model_len=64)
    model.loaded.tokenizer.chat_template = RAISING_TEMPLATE
    conversations = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                     [{"role": "user", "content": "hi"}]]
    refused, answered = model.chat(conversations, GREEDY, use_tqdm=False)
    assert "System role not supported" in refused.error and refused.outputs == []
    assert answered.error is None and len(answered.outputs[0].token_ids) == 4


def test_a_call_that_cannot_queue_every_request_leaves_none_queued(monkeypatch):
    model = llm()
    real_add = model.engine.add_request
    queued = []

    def add_then_fail(request_id, *args, **kwargs):
        if queued:   # the second request cannot be queued
            raise RuntimeError("queue refused the request")
        queued.append(request_id)
        return real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(model.engine, "add_request", add_then_fail)
    with pytest.raises(RuntimeError, match="queue refused"):
        model.generate(["hello", "bye"], GREEDY, use_tqdm=False, request_ids=["x1", "x2"])
    monkeypatch.undo()
    assert queued == ["x1"] and not model.engine.has_unfinished()
    seen = []
    outputs = model.generate(["bye"], GREEDY, use_tqdm=False, on_output=seen.append,
                             request_ids=["next"])
    assert [o.request_id for o in seen] == ["next"]     # nothing of the failed call ran
    assert outputs[0].outputs[0].token_ids == alone("bye")
