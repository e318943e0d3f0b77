"""What generate() and chat() accept, normalised: prompts, conversations, sampling params.

Torch-free, so that the run job can share the chat-template rule without importing the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedgen.validation import is_int
from pagedgen.engine.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]
Prompt = str | list[int] | dict[str, Any]


def encode_chat(tokenizer: Any, conversation: Conversation) -> tuple[str, list[int]]:
    """(rendered template with the generation prompt, its token ids), as vLLM does."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a chat conversation ('messages') needs a chat template, and this "
                         "model's tokenizer has none; give a plain prompt instead")
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    # The template already holds the special tokens (BOS): do not add them twice.
    return text, tokenizer.encode(text, add_special_tokens=False)


def normalize_prompts(prompts: Prompt | list[Prompt], tokenizer: Any) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt. A flat list of ints is ONE prompt of token ids."""
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, a dict, or a list of "
                         f"these; got {type(prompts).__name__}")
    return [_one_prompt(p, i, tokenizer) for i, p in enumerate(prompts)]


def _is_token_list(value: object) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(is_int(t) for t in value))


def _one_prompt(prompt: Prompt, index: int, tokenizer: Any) -> tuple[str | None, list[int]]:
    if isinstance(prompt, dict):
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if ids is not None:
            if not _is_token_list(ids) and ids != []:
                raise ValueError(f"prompts[{index}]['prompt_token_ids'] must be a list of ints")
            return text, list(ids)
        if not isinstance(text, str):
            raise ValueError(f"prompts[{index}] must hold 'prompt' (a string) or 'prompt_token_ids'")
        prompt = text
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if _is_token_list(prompt) or prompt == []:
        return None, list(prompt)
    raise ValueError(f"prompts[{index}] must be a string, a list of token ids or a dict, "
                     f"got {type(prompt).__name__}")


def normalize_sampling_params(params: SamplingParams | Iterable[SamplingParams] | None,
                              count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    from pagedgen.engine.beam_search import BeamSearchParams  # lazy: it imports torch

    if isinstance(params, (SamplingParams, BeamSearchParams)):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams (or BeamSearchParams), "
                             f"got {type(p).__name__}")
    return params
