"""What one finished sample looks like to the writers: plain data, no I/O.

Its own module so that both record formats (output_files.py and openai_batch.py) can use it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)   # the most likely alternatives


@dataclass(slots=True)
class SampleResult:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    beam_scores: dict[str, float] | None = None   # beam search: score and cumulative_logprob
