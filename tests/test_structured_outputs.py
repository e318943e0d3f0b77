"""Structured outputs: every sample matches its JSON schema / regex / choice / grammar.

The tiny models have random weights: at temperature 1.0 they emit noise, so whatever
structure the outputs have comes from the constraint alone.
"""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
import torch

from pagedgen import LLM, SamplingParams, StructuredOutputsParams
from pagedgen.engine.structured_outputs import forbidden_tokens
from tiny_models import tiny_hf_model, tiny_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 6},
                                   "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city"], "additionalProperties": False},
        "status": {"enum": ["active", "inactive"]},
    },
    "required": ["name", "age", "status", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{2,4}"
CHOICES = ["yes", "no", "maybe so", "ça dépend"]
# GBNF-style EBNF, as vLLM's grammar= takes it.
GRAMMAR = 'root ::= num | sum\nsum ::= num " + " num | num " + " num " + " num\nnum ::= [1-9] [0-9]?'
GRAMMAR_REGEX = r"[1-9][0-9]?( \+ [1-9][0-9]?){0,2}"
PROMPTS = ["Person record:", "def f(x):", "The answer is", "JSON"]


@functools.cache
def shared_llm() -> LLM:
    return LLM(str(tiny_model_dir()), dtype="float32", num_blocks=512, max_num_seqs=64, seed=0)


def json_params(**extra) -> SamplingParams:
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 300, **extra}, structured_outputs=spec)


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def assert_valid_json(outputs) -> None:
    for o in outputs:
        assert o.error is None
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)


def generate(params: SamplingParams, count: int = 32, llm: LLM | None = None):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    return (llm or shared_llm()).generate(prompts, params, use_tqdm=False)


# --- every sample satisfies its constraint ---

def test_json_schema_samples_parse_and_validate():
    outputs = generate(json_params())
    assert_valid_json(outputs)
    assert len(set(texts(outputs))) > 16          # noise inside the structure: varied outputs


def test_regex_samples_match_fully():
    params = SamplingParams(temperature=1.0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    for text in texts(generate(params)):
        assert re.fullmatch(REGEX, text), text


def test_choice_samples_are_one_of_the_choices():
    params = SamplingParams(temperature=1.0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    outputs = texts(generate(params))
    assert set(outputs) <= set(CHOICES)
    assert len(set(outputs)) > 1


def test_a_complete_grammar_ends_the_sample_even_with_ignore_eos():
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    tokenizer = shared_llm().get_tokenizer()
    for output in generate(params, count=8):
        sample = output.outputs[0]
        assert sample.finish_reason == "stop" and sample.text in CHOICES
        assert tokenizer.decode(sample.token_ids) == sample.text    # no EOS was needed


def test_ebnf_grammar_samples_match():
    params = SamplingParams(temperature=1.0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(grammar=GRAMMAR))
    for output in generate(params, count=16):
        sample = output.outputs[0]
        assert sample.finish_reason == "stop" and re.fullmatch(GRAMMAR_REGEX, sample.text), sample


def test_json_object_is_an_object():
    params = SamplingParams(temperature=1.0, max_tokens=80, structured_outputs=StructuredOutputsParams(
        json_object=True, disable_any_whitespace=True))
    for output in generate(params, count=8):
        sample = output.outputs[0]
        assert sample.text.startswith("{")
        if sample.finish_reason == "stop":
            assert isinstance(json.loads(sample.text), dict)


# --- the mask changes nothing but the forbidden tokens ---

def test_greedy_constrained_is_greedy_unconstrained_wherever_allowed():
    """At every step the constrained greedy token is the argmax of transformers' logits over
    the allowed tokens; where the unconstrained argmax is allowed, it is that token."""
    llm, hf = shared_llm(), tiny_hf_model()
    spec = StructuredOutputsParams(regex=r"[^0-9]{5,40}")
    prompt = llm.get_tokenizer().encode("def wrap(text, width):")
    sample = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40,
                                                   structured_outputs=spec), use_tqdm=False)[0]
    tokens = sample.outputs[0].token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    backend = llm.engine.grammar
    matcher = backend.new_matcher(backend.compile(spec))
    agreed = 0
    for step, token in enumerate(tokens):
        free_choice = int(logits[step].argmax())
        allowed = matcher.deep_copy().consume_token(free_choice)
        masked = logits[step:step + 1].clone()
        backend.mask_logits(masked, [0], [matcher])
        assert token == int(masked.argmax())
        assert (token == free_choice) == allowed
        agreed += allowed
        assert matcher.consume_token(token)
    assert 0 < agreed < len(tokens)   # both cases happened


def test_the_bitmask_allows_token_32w_plus_j_by_bit_j_of_word_w():
    words = torch.tensor([[1 - 2 ** 31, 0, -(2 ** 31)]], dtype=torch.int32)  # bits 0+31, -, 31
    allowed = (~forbidden_tokens(words, 70)).nonzero()[:, 1].tolist()
    assert allowed == [0, 31]                       # bit 31 of word 2 is token 95 > vocab 70
    assert (~forbidden_tokens(words, 96)).nonzero()[:, 1].tolist() == [0, 31, 95]


# --- with the rest of the engine ---

def test_n4_samples_each_follow_the_schema_with_their_own_state():
    outputs = generate(json_params(n=4), count=8)
    assert_valid_json(outputs)
    assert all(len(o.outputs) == 4 and len(set(texts([o]))) > 1 for o in outputs)


def test_preempted_and_chunked_requests_keep_their_constraint_state():
    """Seeded samples draw the same numbers whatever else runs: under preemption (recompute)
    and chunked prefill they must give exactly the tokens of an undisturbed run, which fails
    if replaying recomputed tokens advanced a matcher again."""
    params = [json_params(seed=100 + i) for i in range(12)]
    prompts = [" ".join(["word"] * (20 + i)) for i in range(12)]
    calm = LLM(str(tiny_model_dir()), dtype="float32", num_blocks=512, seed=1)
    expected = calm.generate(prompts, params, use_tqdm=False)
    tight = LLM(str(tiny_model_dir()), dtype="float32", num_blocks=40, block_size=8,
                max_num_batched_tokens=16, max_num_seqs=12, seed=2)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.stats.preemptions > 0
    assert_valid_json(outputs)
    assert texts(outputs) == texts(expected)
    tight.engine.kv.check_integrity()


def test_max_tokens_truncates_with_length_and_stop_strings_cut():
    short = generate(json_params(max_tokens=5), count=4)
    assert all(o.outputs[0].finish_reason == "length" for o in short)
    assert all(len(o.outputs[0].token_ids) == 5 for o in short)
    stopped = generate(json_params(stop=['"age"']), count=4)
    for o in stopped:
        assert o.outputs[0].stop_reason == '"age"'
        assert o.outputs[0].text.startswith('{"name":"') and '"age"' not in o.outputs[0].text


def test_prefix_cache_hits_do_not_disturb_constraints():
    llm = shared_llm()
    outputs = llm.generate(["shared prefix " * 10 + str(i) for i in range(8)], json_params(),
                           use_tqdm=False)
    assert_valid_json(outputs)
    assert sum(o.usage.cached_prompt_tokens for o in outputs) > 0


# --- bad constraints ---

@pytest.mark.parametrize("spec, named", [
    (dict(json={"type": "no-such-type"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json: not JSON"),
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(grammar='root ::= "unterminated'), "structured_outputs.grammar"),
])
def test_an_invalid_constraint_fails_its_request_alone(spec, named):
    good = json_params()
    bad = SamplingParams(temperature=1.0, structured_outputs=StructuredOutputsParams(**spec))
    outputs = shared_llm().generate(["a", "b", "c"], [good, bad, good], use_tqdm=False)
    assert named in outputs[1].error and outputs[1].outputs == []
    assert_valid_json([outputs[0], outputs[2]])


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of"),
    (dict(json={}, regex="a"), "got json, regex"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(json_object="yes"), "json_object must be true"),
    (dict(regex=""), "regex must be a non-empty string"),
])
def test_the_params_shape_is_checked_at_once(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_a_plain_dict_like_a_jsonl_field():
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="unknown key 'regexp'"):
        SamplingParams(structured_outputs={"regexp": "a+"})
