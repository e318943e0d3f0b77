"""load_model: an HF folder, a .gguf file, or None (the built-in default) -> LoadedModel."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from pagedgen.model.config import ModelConfig
from pagedgen.model.dtypes import resolve_dtype
from pagedgen.model.errors import load_errors_named
from pagedgen.model.layers.llama import LlamaDecoder
from pagedgen.model.loading import gguf_loader, safetensors_loader
from pagedgen.model.loading import tokenizer as tokenizers
from pagedgen.model.loading.size_check import (GGUF_MIN_BYTES_PER_WEIGHT,
                                               SAFETENSORS_MIN_BYTES_PER_WEIGHT,
                                               check_config_fits_files)
from pagedgen.model.loading.source import locate_model
from pagedgen.model.loading.weights import load_weights


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module  # LlamaDecoder, in eval mode, weights on `device` in `dtype`
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    name: str
    eos_token_ids: list[int]
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def load_model(model: str | Path | None, dtype: str | torch.dtype | None = None,
               device: str | torch.device = "cpu", tokenizer: str | Path | None = None) -> LoadedModel:
    """Load weights (safetensors or GGUF only) and the tokenizer.

    model: an HF folder (config.json + safetensors), a .gguf file, a folder holding exactly one
    .gguf file, or None for the built-in SmolLM2-135M-Instruct. Nothing is downloaded.
    tokenizer: a folder to take the tokenizer from instead of the model's own (for GGUF, its
    vocabulary must then be the file's). Any failure to read the files is a ModelLoadError
    (a ValueError) naming the file and the reason.
    """
    device = torch.device(device)
    run_dtype = resolve_dtype(dtype, device)
    source = locate_model(model)
    with load_errors_named(source.path):
        if source.kind == "hf":
            return _load_hf_folder(source.path, run_dtype, device, tokenizer)
        return _load_gguf(source.path, run_dtype, device, source.name, tokenizer)


def _load_hf_folder(folder: Path, dtype: torch.dtype, device: torch.device,
                    tokenizer_folder: str | Path | None) -> LoadedModel:
    config, raw = safetensors_loader.read_hf_config(folder)
    check_config_fits_files(config, safetensors_loader.open_safetensors(folder),
                            SAFETENSORS_MIN_BYTES_PER_WEIGHT, folder / "config.json")
    decoder = build_decoder(config, safetensors_loader.iter_safetensors(folder), dtype, device)
    tokenizer = tokenizers.load_folder_tokenizer(Path(tokenizer_folder or folder))
    eos = tokenizers.merge_eos_ids(tokenizer, tokenizers.folder_eos_token_ids(folder, raw))
    return LoadedModel(model=decoder, tokenizer=tokenizer, config=decoder.config, name=folder.name,
                       eos_token_ids=eos, dtype=dtype, device=device)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, name: str,
               tokenizer_folder: str | Path | None) -> LoadedModel:
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.gguf_model_config(reader)
    check_config_fits_files(config, [path], GGUF_MIN_BYTES_PER_WEIGHT, path)
    decoder = build_decoder(config, gguf_loader.iter_gguf_tensors(reader, config), dtype, device)
    tokenizer = tokenizers.load_gguf_tokenizer(path)
    if tokenizer_folder is not None:
        tokenizer = tokenizers.matching_tokenizer(Path(tokenizer_folder), tokenizer, path)
    eos = tokenizers.merge_eos_ids(tokenizer, gguf_loader.gguf_eos_token_ids(reader))
    return LoadedModel(model=decoder, tokenizer=tokenizer, config=decoder.config, name=name,
                       eos_token_ids=eos, dtype=dtype, device=device)


def build_decoder(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]],
                  dtype: torch.dtype, device: torch.device) -> LlamaDecoder:
    """Decoder with uninitialised storage (built on 'meta', then materialised), then filled."""
    with torch.device("meta"):
        decoder = LlamaDecoder(config).to(dtype)  # dtype first: storage is allocated once
    decoder = decoder.to_empty(device=device)
    if config.tie_word_embeddings:
        decoder.tie_lm_head()  # to_empty made two tensors of the one shared parameter
    load_weights(decoder, tensors)
    if decoder.is_tied and not config.tie_word_embeddings:
        # The file had no lm_head: record what the model really is.
        decoder.config.tie_word_embeddings = True
    decoder.reset_rope_table()
    return decoder.eval().requires_grad_(False)
