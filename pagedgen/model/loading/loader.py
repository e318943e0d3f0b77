"""load_model: an HF folder, a .gguf file, or None (the built-in default) -> LoadedModel."""
from __future__ import annotations

import os
from collections.abc import Iterable
from math import prod
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from pagedgen.model.config import ModelConfig
from pagedgen.model.device import resolve_device
from pagedgen.model.dtypes import resolve_dtype
from pagedgen.model.errors import load_errors_named
from pagedgen.model.layers.decoder import Decoder
from pagedgen.model.loading import gguf_loader, gguf_packed, safetensors_loader
from pagedgen.model.loading import tokenizer as tokenizers
from pagedgen.model.loading.size_check import (GGUF_MIN_BYTES_PER_WEIGHT,
                                               SAFETENSORS_MIN_BYTES_PER_WEIGHT,
                                               check_config_fits_files)
from pagedgen.model.loading.source import ModelSource, locate_model
from pagedgen.model.loading.weights import load_weights


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module  # Decoder, in eval mode, weights on `device` in `dtype`
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    name: str
    eos_token_ids: list[int]
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


# The values of the `weights` setting this build can load (pagedgen/settings/table.py).
WEIGHTS_FORMATS = ("auto", "packed", "dequantized")


def load_model(model: str | Path | None, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, tokenizer: str | Path | None = None,
               weights: str | None = None) -> LoadedModel:
    """Load weights (safetensors or GGUF only) and the tokenizer.

    model: an HF folder (config.json + safetensors), a .gguf file, a folder holding exactly one
    .gguf file, or None for the built-in SmolLM2-135M-Instruct. Nothing is downloaded.
    tokenizer: a folder to take the tokenizer from instead of the model's own (for GGUF, its
    vocabulary must then be the file's). Any failure to read the files is a ModelLoadError
    (a ValueError) naming the file and the reason.
    device: None or "auto": CUDA when available, else CPU. weights: the `weights` setting
    (None: "auto"): "packed" keeps a GGUF file's quantized matrices in their blocks,
    memory-mapped (CPU only; docs/gguf_weights.md), "dequantized" expands them to `dtype` at
    load, "auto" is packed for a GGUF on CPU in bfloat16 where the packed kernels decode in
    registers (AVX2, AVX-512), elsewhere where the dequantized copy would crowd memory
    (_resolve_auto), dequantized otherwise.
    """
    _check_weights_format(weights)
    device = torch.device(resolve_device(device))
    source = locate_model(model)
    run_dtype = resolve_dtype(dtype, device, lambda: stays_packed(source, weights, device))
    with load_errors_named(source.path):
        if source.kind == "hf":
            if weights == "packed":
                raise ValueError("weights='packed' needs a GGUF file; "
                                 f"{source.path} is a safetensors folder")
            return _load_hf_folder(source.path, run_dtype, device, tokenizer)
        return _load_gguf(source.path, run_dtype, device, source.name, tokenizer,
                          weights or "auto")


def stays_packed(source: ModelSource, weights: str | None, device: torch.device | str) -> bool:
    """Whether a model source's weights stay GGUF blocks whatever the dtype turns out to be:
    asked for, or "auto" where the packed kernels decode in registers (_resolve_auto keeps
    those packed in bfloat16, the dtype "auto" then takes)."""
    if source.kind != "gguf" or torch.device(device).type != "cpu":
        return False
    return weights == "packed" or (weights in (None, "auto") and gguf_packed.fast_packed_kernels())


def _check_weights_format(weights: str | None) -> None:
    if weights not in (None, *WEIGHTS_FORMATS):
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS_FORMATS)}, got {weights!r}")


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
               tokenizer_folder: str | Path | None, weights: str) -> LoadedModel:
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.gguf_model_config(reader)
    check_config_fits_files(config, [path], GGUF_MIN_BYTES_PER_WEIGHT, path)
    library = packed_library(_resolve_auto(weights, reader, dtype, device), device)
    if library is not None:
        decoder = gguf_packed.build_packed_decoder(config, reader, dtype, library)
    else:
        decoder = build_decoder(config, gguf_loader.iter_gguf_tensors(reader, config), dtype,
                                device)
    tokenizer = tokenizers.load_gguf_tokenizer(path)
    if tokenizer_folder is not None:
        tokenizer = tokenizers.matching_tokenizer(Path(tokenizer_folder), tokenizer, path)
    end_of_turn = tokenizers.complete_family_chat(tokenizer, gguf_loader.gguf_architecture(reader))
    eos = tokenizers.merge_eos_ids(tokenizer, gguf_loader.gguf_eos_token_ids(reader), end_of_turn)
    return LoadedModel(model=decoder, tokenizer=tokenizer, config=decoder.config, name=name,
                       eos_token_ids=eos, dtype=dtype, device=device)


# "auto" keeps a bfloat16 run's GGUF packed where the packed kernels decode in registers
# (AVX2, AVX-512): there they and the fused decode step decode faster than the dequantized
# model at batch 1 and about as fast with many sequences, in a third to a half of the memory
# (docs/gguf_weights.md). Elsewhere (the portable kernels), and in a float32 run (transformers'
# oracle path), it dequantizes unless the dequantized copy would crowd memory (a 4.9 GB
# Q4_K_M 8B file is ~32 GB in float32).
AUTO_PACKED_MEMORY_SHARE = 0.25


def _resolve_auto(weights: str, reader, dtype: torch.dtype, device: torch.device) -> str:
    if weights != "auto":
        return weights
    if device.type != "cpu":  # the packed kernels are CPU kernels
        return "dequantized"
    if dtype == torch.bfloat16 and gguf_packed.fast_packed_kernels():
        return "packed"
    expanded = sum(prod(t.shape) for t in reader.tensors) * dtype.itemsize
    return "packed" if expanded > AUTO_PACKED_MEMORY_SHARE * _available_memory() else "dequantized"


def _available_memory() -> int:
    """MemAvailable in bytes (Linux); elsewhere the physical memory, else no limit."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def packed_library(weights: str, device: torch.device):
    """The packed-GGUF kernel library when the weights stay packed, else None (dequantize)."""
    if weights == "dequantized":
        return None
    if device.type != "cpu":
        if weights == "packed":
            raise ValueError(f"weights='packed' runs on CPU only (device {device}); use "
                             "weights='dequantized'")
        return None
    return gguf_packed.packed_kernels_available()  # None (one warning): no compiler


def build_decoder(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]],
                  dtype: torch.dtype, device: torch.device) -> Decoder:
    """Decoder with uninitialised storage (built on 'meta', then materialised), then filled."""
    with torch.device("meta"):
        decoder = Decoder(config).to(dtype)  # dtype first: storage is allocated once
    decoder = decoder.to_empty(device=device)
    if config.tie_word_embeddings:
        decoder.tie_lm_head()  # to_empty made two tensors of the one shared parameter
    load_weights(decoder, tensors)
    if decoder.is_tied and not config.tie_word_embeddings:
        # The file had no lm_head: record what the model really is.
        decoder.config.tie_word_embeddings = True
    decoder.reset_rope_table()
    return decoder.eval().requires_grad_(False)
