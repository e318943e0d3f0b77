"""One request record -> what the engine takes (prompt token ids, SamplingParams), checked
against the loaded model. Shared by the run job and `profile` (file workloads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedgen.jobs.input_records import Request, line_too_long
from pagedgen.jobs.stop_signals import is_stop
from pagedgen.prompts import encode_chat
from pagedgen.validation import shorten

if TYPE_CHECKING:
    from pagedgen.llm import LLM


def prompt_token_ids(request: Request, tokenizer: Any) -> list[int]:
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    if request.messages is None:
        return _guarded("tokenizing the prompt", tokenizer.encode, request.prompt)
    # The same rule as LLM.chat. A template may raise on purpose (raise_exception in Llama-2 and
    # Mistral templates, e.g. for roles out of order): that is this line's error.
    return _guarded("the chat template", encode_chat, tokenizer, request.messages)[1]


def _guarded(what: str, function: Any, *args: Any) -> Any:
    try:
        return function(*args)
    except BaseException as exc:  # noqa: BLE001 - tokenizers raise pyo3 panics (BaseException)
        if is_stop(exc):
            raise
        raise ValueError(f"{what} failed: {type(exc).__name__}: {shorten(str(exc))}") from None


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt is {len(ids)} tokens; max_model_len is {max_model_len}, which "
                         f"leaves room for prompts of at most {max_model_len - 1} tokens")
    if max(ids) >= vocab_size:
        raise ValueError(f"prompt token id {max(ids)} is outside the vocabulary (size {vocab_size})")


@dataclass(slots=True)
class Prepared:
    request: Request
    token_ids: list[int]
    params: Any                      # SamplingParams


def prepare(request: Request, llm: LLM, max_bytes: int | None = None) -> Prepared:
    """Tokenize and check one request against the loaded model; ValueError says why not.
    A line over `max_bytes` is refused before its prompt is tokenized."""
    from pagedgen.engine.sampling_params import SamplingParams

    if max_bytes is not None and request.size > max_bytes:
        raise ValueError(line_too_long(max_bytes))
    ids = prompt_token_ids(request, llm.get_tokenizer())
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    check_prompt(ids, llm.max_model_len, llm.loaded.config.vocab_size)
    try:
        if "beam_width" in request.sampling:
            params = beam_search_params(request.sampling)
        elif "length_penalty" in request.sampling:
            raise ValueError("'length_penalty' applies to beam search only: add 'beam_width'")
        else:
            params = SamplingParams(**request.sampling)
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None
    return Prepared(request, ids, params)


def beam_search_params(sampling: dict[str, Any]) -> Any:
    """BeamSearchParams from a line's fields; sampling-only fields (top_p, seed...) are ignored,
    those that contradict beam search are errors."""
    from pagedgen.engine.beam_search import BeamSearchParams

    for key in ("stop", "stop_token_ids", "logprobs"):
        if sampling.get(key):
            raise ValueError(f"{key!r} cannot be combined with 'beam_width'")
    if sampling.get("n", 1) != 1:
        raise ValueError("'n' cannot be combined with 'beam_width' (the beams are the outputs)")
    kept = ("max_tokens", "ignore_eos", "length_penalty", "include_stop_str_in_output")
    return BeamSearchParams(sampling["beam_width"], **{k: sampling[k] for k in kept if k in sampling})
