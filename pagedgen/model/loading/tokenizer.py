"""Tokenizers (and chat templates) through transformers, from an HF folder or a GGUF file.

For GGUF, PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...) builds the same
tokenizer as AutoTokenizer an order of magnitude sooner: AutoTokenizer first resolves a model
config, which parses the whole file again with gguf's slow reader (bench/FIGURES.md; tests
check both give the same ids).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load a tokenizer from {folder} (tokenizer.json / "
                         f"tokenizer_config.json expected): {error}") from error


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name,
                                                       local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"cannot build a tokenizer from GGUF file {path}: {error}") from error


def folder_eos_token_ids(folder: Path, raw_config: dict[str, Any]) -> list[int]:
    """EOS ids from config.json and generation_config.json (which may list several)."""
    ids = _as_list(raw_config.get("eos_token_id"))
    generation_config = folder / "generation_config.json"
    if generation_config.is_file():
        ids += _as_list(json.loads(generation_config.read_text()).get("eos_token_id"))
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
