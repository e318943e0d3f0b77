"""What generate() and chat() accept, normalised: prompts, conversations, sampling params.

Torch-free, so that the run job can share the chat-template rule without importing the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pagedgen.validation import is_int
from pagedgen.engine.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]
Prompt = str | list[int] | dict[str, Any]


@dataclass(slots=True)
class EncodedPrompt:
    text: str | None
    token_ids: list[int]
    error: str | None = None   # why this prompt alone cannot run (the others still do)


def check_text(text: str, what: str) -> str:
    """`text` when it is valid Unicode; a lone surrogate (e.g. "a\\ud800b" from a broken
    decoder) would otherwise reach the tokenizer and fail there with an unrelated message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} holds a lone surrogate {text[error.start]!r} at character "
                         f"{error.start}, which is not valid Unicode text") from None
    return text


def encode_chat(tokenizer: Any, conversation: Conversation) -> tuple[str, list[int]]:
    """(rendered template with the generation prompt, its token ids), as vLLM does."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a chat conversation ('messages') needs a chat template, and this "
                         "model's tokenizer has none; give a plain prompt instead")
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    check_text(text, "the conversation rendered by the chat template")
    # The template already holds the special tokens (BOS): do not add them twice.
    return text, tokenizer.encode(text, add_special_tokens=False)


def encode_isolated(encode: Callable[[], tuple[str | None, list[int]]],
                    text: str | None = None) -> EncodedPrompt:
    """Runs one prompt's templating/tokenizing; what goes wrong there is that prompt's error.

    Anything can come out of a user's chat template (raise_exception) or of a tokenizer fed
    odd text, and it concerns this prompt only: the batch goes on without it."""
    try:
        text, ids = encode()
    except Exception as error:  # noqa: BLE001 - isolation boundary of one prompt, see above
        return EncodedPrompt(text, [], _one_line(error))
    return EncodedPrompt(text, ids)


def _one_line(error: Exception) -> str:
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return first if isinstance(error, ValueError) and first else f"{type(error).__name__}: {first}"


def normalize_prompts(prompts: Prompt | list[Prompt], tokenizer: Any) -> list[EncodedPrompt]:
    """One EncodedPrompt per prompt. A flat list of ints is ONE prompt of token ids.

    A prompt of the wrong type is the caller's mistake (ValueError for the whole call); a
    text that cannot be tokenized fails alone (its `error` is set)."""
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, a dict, or a list of "
                         f"these; got {type(prompts).__name__}")
    return [_one_prompt(p, i, tokenizer) for i, p in enumerate(prompts)]


def _is_token_list(value: object) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(is_int(t) for t in value))


def _one_prompt(prompt: Prompt, index: int, tokenizer: Any) -> EncodedPrompt:
    if isinstance(prompt, dict):
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if ids is not None:
            if not _is_token_list(ids) and ids != []:
                raise ValueError(f"prompts[{index}]['prompt_token_ids'] must be a list of ints")
            return EncodedPrompt(text, list(ids))
        if not isinstance(text, str):
            raise ValueError(f"prompts[{index}] must hold 'prompt' (a string) or 'prompt_token_ids'")
        prompt = text
    if isinstance(prompt, str):
        text = prompt
        return encode_isolated(lambda: (text, tokenizer.encode(check_text(text, f"prompts[{index}]"))),
                               text)
    if _is_token_list(prompt) or prompt == []:
        return EncodedPrompt(None, list(prompt))
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
