"""One request record -> what the engine takes (prompt token ids, SamplingParams), checked
against the loaded model. Shared by the run job and `profile` (file workloads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedgen.cli.input_records import Request
from pagedgen.prompts import encode_chat

if TYPE_CHECKING:
    from pagedgen.llm import LLM


def prompt_token_ids(request: Request, tokenizer: Any) -> list[int]:
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    if request.messages is None:
        return tokenizer.encode(request.prompt)
    return encode_chat(tokenizer, request.messages)[1]   # the same rule as LLM.chat


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


def prepare(request: Request, llm: LLM) -> Prepared:
    """Tokenize and check one request against the loaded model; ValueError says why not."""
    from pagedgen.engine.sampling_params import SamplingParams

    ids = prompt_token_ids(request, llm.get_tokenizer())
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    check_prompt(ids, llm.max_model_len, llm.loaded.config.vocab_size)
    try:
        params = SamplingParams(**request.sampling)
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None
    return Prepared(request, ids, params)
