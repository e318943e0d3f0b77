"""Per-request sampling parameters (vLLM's offline `SamplingParams`, validated).

The vectorized sampler that applies them lives in `pagedgen/engine/sampler.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from pagedgen.engine.structured_params import StructuredOutputsParams
from pagedgen.validation import brief, is_int

# vLLM defaults to 16 new tokens, which silently truncates almost every real answer. 256 is long
# enough for a paragraph or a short chat reply, and short enough that a batch without explicit
# limits still finishes in reasonable time on a CPU.
DEFAULT_MAX_TOKENS = 256

# Below this temperature sampling is treated as greedy (vLLM uses the same epsilon): dividing
# logits by ~0 would only produce inf/nan.
GREEDY_EPSILON = 1e-5


# --- the rules: one table for SamplingParams, JSONL lines, batch bodies and config files ---
#
# Each rule returns the value normalised (e.g. "stop": "x" -> ["x"]) or raises
# ValueError(requirement). SamplingParams runs every field through its rule at construction; the
# JSONL reader and the config's `sampling:` section accept exactly the keys of this table. A new
# field gets one entry here and is then accepted and checked everywhere.

Rule = Callable[[Any], Any]

# Counts and token ids end up in int32/int64 tensors: a bound here keeps a huge value a clear
# error instead of an overflow in the middle of an engine step.
INT32_MAX = 2**31 - 1
SEED_LIMIT = 2**64          # torch generators take unsigned 64-bit seeds
MAX_LOGPROBS = 20           # vLLM's default max_logprobs
MAX_TEMPERATURE = 100.0


def _integer(low: int, high: int = INT32_MAX) -> Rule:
    def check(value: Any) -> int:
        if not is_int(value) or value < low:
            raise ValueError(f"must be an integer >= {low}")
        if value > high:
            raise ValueError(f"must be an integer <= {high}")
        return value
    return check


def _number(low: float, high: float, *, low_open: bool = False) -> Rule:
    requirement = f"must be a number in {'(' if low_open else '['}{low}, {high}]"

    def check(value: Any) -> float:
        # Compared before any float(): float(10**400) itself overflows.
        finite = is_int(value) or (isinstance(value, float) and math.isfinite(value))
        if not finite or value < low or value > high or (low_open and value == low):
            raise ValueError(requirement)
        return float(value)
    return check


def _optional(rule: Rule, requirement: str) -> Rule:
    def check(value: Any) -> Any:
        if value is None:
            return None
        try:
            return rule(value)
        except ValueError:
            raise ValueError(requirement) from None
    return check


def _top_k(value: Any) -> int:
    if not is_int(value) or not -1 <= value <= INT32_MAX:
        raise ValueError("must be an integer >= 1, or 0 / -1 for no top-k cut")
    return max(value, 0)    # -1 is vLLM's spelling of "no top-k"


def _stop(value: Any) -> list[str]:
    values = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(s, str) and s for s in values):
        raise ValueError("must be a non-empty string or a list of non-empty strings")
    return list(values)


def _token_ids(value: Any) -> list[int]:
    values = [] if value is None else value
    if not isinstance(values, (list, tuple)) or not all(is_int(t) and 0 <= t <= INT32_MAX
                                                        for t in values):
        raise ValueError("must be a list of non-negative integers (token ids)")
    return list(values)


def _structured_outputs(value: Any) -> Any:
    """Checked by shape ({"json": ...} / {"regex": ...} / ...) and kept as given, so a JSONL
    line's dict stays plain data; SamplingParams turns it into StructuredOutputsParams. A schema
    or regex that does not compile fails its request when the model's tokenizer compiles it."""
    if value is None:
        return None
    try:
        StructuredOutputsParams.from_dict(value)
    except (TypeError, ValueError) as exc:
        raise ValueShownError(f"is invalid: {exc}") from None   # its message shows the value
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


SAMPLING_RULES: dict[str, Rule] = {
    "n": _integer(1),
    "max_tokens": _integer(1),
    "min_tokens": _integer(0),
    "temperature": _number(0.0, MAX_TEMPERATURE),
    "top_p": _number(0.0, 1.0, low_open=True),
    "top_k": _top_k,
    "min_p": _number(0.0, 1.0),
    "seed": _optional(_integer(0, SEED_LIMIT - 1), "must be an integer in [0, 2**64 - 1] or null"),
    "stop": _stop,
    "stop_token_ids": _token_ids,
    "ignore_eos": _flag,
    "include_stop_str_in_output": _flag,
    "skip_special_tokens": _flag,
    "logprobs": _optional(_integer(0, MAX_LOGPROBS), f"must be an integer in [0, {MAX_LOGPROBS}] "
                          "(top alternatives per token) or null"),
    "presence_penalty": _number(-2.0, 2.0),
    "frequency_penalty": _number(-2.0, 2.0),
    "repetition_penalty": _number(0.0, 100.0, low_open=True),
    "structured_outputs": _structured_outputs,
    "prompt_logprobs": _optional(_integer(0, MAX_LOGPROBS), f"must be an integer in "
                                 f"[0, {MAX_LOGPROBS}] (top alternatives per prompt token) or null"),
}

# Fields whose value is a number of sequences that run side by side for one request: each takes
# one of the engine's max_num_seqs seats, so a request above that limit could never be admitted.
PARALLEL_FIELDS = ("n", "beam_width")

# A request with "beam_width" runs beam search (BeamSearchParams); its own two fields.
BEAM_SEARCH_RULES: dict[str, Rule] = {
    "beam_width": _integer(1),
    "length_penalty": _number(-100.0, 100.0),
}
REQUEST_RULES: dict[str, Rule] = {**SAMPLING_RULES, **BEAM_SEARCH_RULES}


class ValueShownError(ValueError):
    """A rule's failure whose message already shows the value (no second ", got ...")."""


class SamplingFieldError(ValueError):
    """A sampling field broke its rule; `label` is how the caller names fields."""

    def __init__(self, name: str, requirement: str, value: Any, label: str = "'{}'",
                 value_shown: bool = False):
        self.name, self.requirement = name, requirement
        got = "" if value_shown else f", got {brief(value)}"
        super().__init__(f"{label.format(name)} {requirement}{got}")


def check_field(name: str, value: Any, label: str = "'{}'") -> Any:
    """The normalised value of sampling field `name`, or SamplingFieldError."""
    try:
        return REQUEST_RULES[name](value)
    except ValueError as exc:
        raise SamplingFieldError(name, str(exc), value, label,
                                 isinstance(exc, ValueShownError)) from None


def check_combination(values: dict[str, Any], label: str = "'{}'") -> None:
    """Rules between fields (after a line's fields are merged onto the defaults)."""
    min_tokens, max_tokens = values.get("min_tokens", 0), values.get("max_tokens", math.inf)
    if min_tokens > max_tokens:
        raise ValueError(f"{label.format('min_tokens')} ({min_tokens}) exceeds "
                         f"{label.format('max_tokens')} ({max_tokens})")


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completion(s) of one request; mirrors vLLM's field names and meaning.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters. `stop`
    strings are matched on the decoded text, also across token boundaries; the text is cut
    before the stop string unless `include_stop_str_in_output`. `logprobs=k` returns the top-k
    log-probabilities (of the raw model distribution) at each generated position, plus the
    sampled token's. Penalties follow vLLM/OpenAI: presence and frequency penalties subtract
    from the logits of tokens already generated; the repetition penalty divides positive
    (multiplies negative) logits of tokens seen in the prompt or the output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # The output must match this JSON schema / regex / choice / grammar (structured_params.py).
    structured_outputs: StructuredOutputsParams | None = None
    # Top-k logprobs of every prompt token (None for the first, which nothing predicts).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        label = "SamplingParams.{}"
        for name in (f.name for f in fields(self) if f.name in SAMPLING_RULES):
            setattr(self, name, check_field(name, getattr(self, name), label))
        check_combination({"min_tokens": self.min_tokens, "max_tokens": self.max_tokens}, label)
        if self.structured_outputs is not None:  # a plain dict (a JSONL field) is accepted too
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


