"""What generate() and chat() accept, normalised: prompts, conversations, sampling params.

Torch-free, so that the run job can share the chat-template rule without importing the engine.
"""

from __future__ import annotations

import numbers
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


# --- one set of rules for the API and the JSONL lines (jobs/input_records.py uses these) ---

MESSAGE_KEYS = ("role", "content", "name")
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def validate_prompt_text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    return value


def as_token_ids(value: Any) -> list[int] | None:
    """`value` as a list of Python ints when it is a sequence of integers (numpy arrays, lists
    of numpy integers and torch tensors included), else None. Booleans are not token ids."""
    if hasattr(value, "tolist") and hasattr(value, "ndim") and not isinstance(value, (list, tuple)):
        if value.ndim != 1:
            return None
        value = value.tolist()   # numpy / torch integers become Python ints
    if not isinstance(value, (list, tuple)):
        return None
    ids = []
    for token in value:
        if not _integral(token):
            return None
        ids.append(int(token))
    return ids


def _integral(value: Any) -> bool:
    # numpy integer scalars (np.int64, np.uint32...) register as numbers.Integral; bool and
    # np.bool_ do not count.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def validate_token_ids(value: Any, what: str) -> list[int]:
    ids = as_token_ids(value)
    if not ids or any(t < 0 for t in ids):
        raise ValueError(f"{what} must be a non-empty list of non-negative integers")
    return ids


def _message_text(index: int, content: Any) -> str:
    """A message's text; OpenAI-style lists of {"type": "text"} parts are joined."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else None
    if parts is None or not all(isinstance(p, dict) and p.get("type") == "text"
                                and isinstance(p.get("text"), str) for p in parts):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    return "".join(p["text"] for p in parts)


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """A conversation by the JSONL rules: a non-empty list of {"role", "content"[, "name"]}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {'role', 'content'} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', "
                             f"got {type(message).__name__}")
        extra = [k for k in message if k not in MESSAGE_KEYS]
        if extra:
            raise ValueError(f"messages[{i}] has unknown key {str(extra[0])!r} (a message holds "
                             "'role', 'content' and optionally 'name'; tool calls and tool "
                             "results are not supported)")
        if not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"messages[{i}] needs a string 'role' and a 'content'")
        checked.append({"role": message["role"], "content": _message_text(i, message["content"])})
    return checked


def _prompt_dict(prompt: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a {"prompt"} / {"prompt_token_ids"} dict, by the JSONL rules."""
    extra = [k for k in prompt if k not in PROMPT_DICT_KEYS]
    if extra:
        raise ValueError(f"unknown key {str(extra[0])!r} (a prompt dict holds 'prompt' or "
                         "'prompt_token_ids')")
    if "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError("'prompt' must be a string")
        return text, validate_token_ids(prompt["prompt_token_ids"], "'prompt_token_ids'")
    if "prompt" not in prompt:
        raise ValueError("needs 'prompt' (a string) or 'prompt_token_ids'")
    return validate_prompt_text(prompt["prompt"], "'prompt'"), None


# --- generate() and chat() ---

def normalize_prompts(prompts: Prompt | list[Prompt], tokenizer: Any) -> list[EncodedPrompt]:
    """One EncodedPrompt per prompt. A flat list of ints (or a 1-D integer array) is ONE
    prompt of token ids.

    A prompt of the wrong type, or a dict that breaks the JSONL lines' rules, is the caller's
    mistake (ValueError for the whole call, naming the prompt); a text that cannot be
    tokenized fails alone (its `error` is set)."""
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, a dict, or a list of "
                         f"these; got {type(prompts).__name__}")
    return [_one_prompt(p, i, tokenizer) for i, p in enumerate(prompts)]


def _is_token_list(value: object) -> bool:
    ids = as_token_ids(value)
    return bool(ids) or (ids == [] and not isinstance(value, (list, tuple)))


def _one_prompt(prompt: Prompt, index: int, tokenizer: Any) -> EncodedPrompt:
    if isinstance(prompt, dict):
        try:
            text, ids = _prompt_dict(prompt)
        except ValueError as error:   # the caller's mistake, like a prompt of the wrong type
            raise ValueError(f"prompts[{index}] must hold 'prompt' (a string) or "
                             f"'prompt_token_ids' and nothing else: {error}") from None
        if ids is not None:
            return EncodedPrompt(text, ids)
        prompt = text
    if isinstance(prompt, str):
        text = prompt
        return encode_isolated(lambda: (text, tokenizer.encode(check_text(text, f"prompts[{index}]"))),
                               text)
    ids = as_token_ids(prompt)
    if ids is not None:
        return EncodedPrompt(None, ids)
    raise ValueError(f"prompts[{index}] must be a string, a list of token ids or a dict, "
                     f"got {type(prompt).__name__}")


def normalize_conversations(conversations: Any) -> list[Any]:
    """chat()'s argument as a list of conversations: one conversation (a list of message
    dicts) or a list of them. Anything else (a string, a list of strings) is refused with
    the shape expected, instead of being taken apart character by character."""
    expected = ("chat() takes a conversation, a list of {'role': ..., 'content': ...} dicts, "
                "or a list of conversations; e.g. llm.chat([{'role': 'user', 'content': 'hi'}])")
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise ValueError(f"{expected}; got {type(conversations).__name__}"
                         + (" (empty)" if isinstance(conversations, (list, tuple)) else ""))
    if all(isinstance(m, dict) for m in conversations):
        return [list(conversations)]
    if all(isinstance(c, (list, tuple)) for c in conversations):
        return [list(c) for c in conversations]
    odd = next(c for c in conversations if not isinstance(c, (dict, list, tuple)))
    raise ValueError(f"{expected}; got a list holding {type(odd).__name__}")


def encode_conversations(tokenizer: Any, conversations: list[Any]) -> list[EncodedPrompt]:
    """Each conversation checked by the JSONL rules (a bad shape is the caller's mistake:
    ValueError naming it), then templated (a template's failure is that conversation's own)."""
    checked = []
    for index, conversation in enumerate(conversations):
        try:
            checked.append(validate_messages(conversation))
        except ValueError as error:
            raise ValueError(f"conversations[{index}]: {error}") from None
    return [encode_isolated(lambda m=messages: encode_chat(tokenizer, m)) for messages in checked]


def normalize_sampling_params(params: SamplingParams | Iterable[SamplingParams] | dict | None,
                              count: int) -> list[SamplingParams]:
    """A SamplingParams (or BeamSearchParams) for all prompts, or one per prompt. A dict is
    taken as SamplingParams(**dict), checked by the same rules (a list may mix both)."""
    if params is None:
        return [SamplingParams()] * count
    from pagedgen.engine.beam_search import BeamSearchParams  # lazy: it imports torch

    if isinstance(params, dict):
        params = _params_from_dict(params, "sampling_params")
    if isinstance(params, (SamplingParams, BeamSearchParams)):
        return [params] * count
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise ValueError("sampling_params must be a SamplingParams, a dict of its fields, or a "
                         f"list of these (one per prompt), got {type(params).__name__}")
    params = [_params_from_dict(p, f"sampling_params[{i}]") if isinstance(p, dict) else p
              for i, p in enumerate(params)]
    if len(params) != count:
        raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams (or BeamSearchParams) "
                             f"or a dict of its fields, got {type(p).__name__}")
    return params


def _params_from_dict(values: dict[str, Any], what: str) -> SamplingParams:
    try:
        return SamplingParams(**values)
    except TypeError as error:   # an unknown field name
        raise ValueError(f"{what}: {error}; SamplingParams' fields are its keyword "
                         "arguments") from None
