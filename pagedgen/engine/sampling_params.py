"""Per-request sampling parameters (vLLM's offline `SamplingParams`, validated).

The vectorized sampler that applies them lives in `pagedgen/engine/sampler.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedgen.validation import is_int

# vLLM defaults to 16 new tokens, which silently truncates almost every real answer. 256 is long
# enough for a paragraph or a short chat reply, and short enough that a batch without explicit
# limits still finishes in reasonable time on a CPU.
DEFAULT_MAX_TOKENS = 256

# Below this temperature sampling is treated as greedy (vLLM uses the same epsilon): dividing
# logits by ~0 would only produce inf/nan.
GREEDY_EPSILON = 1e-5


def _fail(name: str, requirement: str, value: object) -> None:
    raise ValueError(f"SamplingParams.{name} {requirement}, got {value!r}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if not is_int(value):
        _fail(name, "must be an integer", value)
    if value < minimum:
        _fail(name, f"must be >= {minimum}", value)


def _check_float(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(name, "must be a finite number", value)
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        _fail(name, f"must be in {bracket}{low}, {high}]", value)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        _fail(name, "must be True or False", value)


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

    def __post_init__(self) -> None:
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        if self.top_k == -1:  # vLLM's spelling of "no top-k"
            self.top_k = 0
        self._validate_numbers()
        self._validate_flags()

    def _validate_numbers(self) -> None:
        _check_int("n", self.n, 1)
        _check_float("temperature", self.temperature, 0.0, 1e4)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True)

    def _validate_flags(self) -> None:
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _normalize_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        _fail("stop", "must be a string or a list of strings", stop)
    if any(s == "" for s in items):
        _fail("stop", "must not contain empty strings", stop)
    return list(items)


def _normalize_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(
            is_int(t) and t >= 0 for t in ids):
        _fail("stop_token_ids", "must be a list of non-negative integers", ids)
    return list(ids)

