"""Decides, after each new token, whether a sequence is done and why (vLLM's order of checks)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedgen.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class StopDecision:
    finish_reason: str                 # "stop" or "length"
    stop_reason: str | int | None      # the stop string / token id, None for EOS and length
    truncate_text_at: int | None = None  # cut the sequence's text here (stop strings)


def find_stop_string(text: str, new_text_len: int, params: SamplingParams) -> tuple[str, int] | None:
    """Earliest stop string that ends inside the newly added text; returns (stop, cut position).

    Only the tail that could contain a new match is searched: the new text plus len(stop) - 1
    characters before it, so a stop string split across tokens is found when its last piece
    arrives."""
    best: tuple[int, str] | None = None
    for stop in params.stop:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    return stop, index + len(stop) if params.include_stop_str_in_output else index


def check_stop(
    token_id: int,
    num_outputs: int,
    max_tokens: int,
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    text: str | None = None,
    new_text_len: int = 0,
) -> StopDecision | None:
    """`num_outputs` counts the new token; `max_tokens` is already clamped to the model length.
    `text`/`new_text_len` are given only for requests with stop strings."""
    if num_outputs >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return StopDecision("stop", None)
        if token_id in params.stop_token_ids:
            return StopDecision("stop", token_id)
        if text is not None and new_text_len:
            found = find_stop_string(text, new_text_len, params)
            if found is not None:
                return StopDecision("stop", found[0], found[1])
    if num_outputs >= max_tokens:
        return StopDecision("length", None)
    return None
