"""Tokenizers (and chat templates) through transformers, from an HF folder or a GGUF file.

For GGUF, PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...) builds the same
tokenizer as AutoTokenizer an order of magnitude sooner: AutoTokenizer first resolves a model
config, which parses the whole file again with gguf's slow reader (bench/FIGURES.md; tests
check both give the same ids).

Every call passes trust_remote_code=False: a folder whose tokenizer_config.json has an
`auto_map` would otherwise make transformers ask on the terminal whether to run the folder's
Python, one keystroke away from executing it. With False it never asks and never runs it:
such a folder loads its plain tokenizer.json, or is refused with a clear message.

A GGUF file carries its own tokenizer, and that is the one used: transformers reads the
folder around `gguf_file` too, so it is given a private folder holding only the file, and a
tokenizer.json that happens to lie next to the GGUF (another model's) cannot slip in.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagedgen.model.errors import ModelLoadError, load_errors_named
from pagedgen.model.loading.chat_templates import FAMILY_CHAT


# Any one of these lets transformers build a tokenizer (with tokenizer_config.json or not).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"the folder has no tokenizer files (one of {', '.join(TOKENIZER_FILES)} "
                             "is needed, usually with tokenizer_config.json); copy them from the "
                             "model's repository, or name a folder that has them as the tokenizer",
                             folder)
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                             trust_remote_code=False)
    except (OSError, ValueError) as error:
        if "custom code" in str(error):   # transformers' text would advise trust_remote_code=True
            reason = ("its tokenizer_config.json asks for the folder's own Python code "
                      "(auto_map / tokenizer_class), and custom tokenizer code is never run; "
                      "give the folder a plain tokenizer.json and a standard tokenizer_class")
        else:
            reason = (f"cannot load a tokenizer (tokenizer.json / tokenizer_config.json expected): "
                      f"{_first_line(error)}")
        raise ModelLoadError(reason, folder) from error


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        with tempfile.TemporaryDirectory(prefix="pagedgen-gguf-") as alone:
            (Path(alone) / path.name).symlink_to(path.resolve())
            return PreTrainedTokenizerFast.from_pretrained(alone, gguf_file=path.name,
                                                           local_files_only=True,
                                                           trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelLoadError(f"cannot build a tokenizer from the GGUF file: {_first_line(error)}",
                             path) from error


def complete_family_chat(tokenizer: PreTrainedTokenizerBase, architecture: str) -> list[int]:
    """Give a GGUF tokenizer its family's chat template when the file carries none, and return
    the ids of the family's end-of-turn tokens (Gemma's <end_of_turn>) found in its vocabulary."""
    template, end_tokens = FAMILY_CHAT.get(architecture, (None, ()))
    if template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = template
    vocab = tokenizer.get_vocab()
    return [vocab[token] for token in end_tokens if token in vocab]


def matching_tokenizer(folder: Path, embedded: PreTrainedTokenizerBase,
                       gguf_path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of `folder`, asked for explicitly next to a GGUF file: it must have the
    file's own vocabulary (same token for every id), else the ids would mean other words."""
    chosen = load_folder_tokenizer(folder)
    ours, theirs = chosen.get_vocab(), embedded.get_vocab()
    if ours != theirs:
        ours_by_id = {i: t for t, i in ours.items()}
        theirs_by_id = {i: t for t, i in theirs.items()}
        differing = min((i for i in ours_by_id.keys() | theirs_by_id.keys()
                         if ours_by_id.get(i) != theirs_by_id.get(i)), default=None)
        raise ModelLoadError(
            f"the tokenizer of {folder} ({len(ours)} tokens) does not match the vocabulary "
            f"embedded in the GGUF file ({len(theirs)} tokens; first differing id: {differing}); "
            "leave the tokenizer unset to use the file's own", gguf_path)
    return chosen


def _first_line(error: BaseException, limit: int = 400) -> str:
    """The library's message on one line, whole sentences only (its lines are wrapped
    mid-sentence, so the first line alone can stop in the middle of one)."""
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) <= limit:
        return text
    cut = text.rfind(". ", 0, limit)
    return text[:cut + 1] if cut > 0 else text[:limit] + "..."


def folder_eos_token_ids(folder: Path, raw_config: dict[str, Any]) -> list[int]:
    """EOS ids from config.json and generation_config.json (which may list several)."""
    ids = _as_list(raw_config.get("eos_token_id"))
    generation_config = folder / "generation_config.json"
    if generation_config.is_file():
        with load_errors_named(generation_config):
            raw = json.loads(generation_config.read_text(encoding="utf-8"))
            if not isinstance(raw, dict):
                raise ModelLoadError(f"must hold a JSON object, not a {type(raw).__name__}")
            ids += _as_list(raw.get("eos_token_id"))
    return ids


def merge_eos_ids(tokenizer: PreTrainedTokenizerBase, *declared: list[int]) -> list[int]:
    """The tokenizer's EOS first, then every other declared id, without repeats."""
    ids = _as_list(tokenizer.eos_token_id)
    for extra in declared:
        ids += extra
    return list(dict.fromkeys(ids))


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
