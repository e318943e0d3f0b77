"""Hugging Face model folders: config.json + model.safetensors or sharded safetensors + index.

Only safetensors is read: pickled checkpoints (pytorch_model.bin) can run code on load, so
they are refused with a message saying how to convert them.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedgen.model.config import ModelConfig
from pagedgen.model.errors import ModelLoadError, load_errors_named
from pagedgen.model.loading.hf_config import model_config_from_hf

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_hf_config(folder: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, the raw config.json mapping)."""
    config_path = folder / "config.json"
    with load_errors_named(config_path):
        raw = json.loads(config_path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ModelLoadError(f"must hold a JSON object, not a {type(raw).__name__}")
        return model_config_from_hf(raw), raw


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of the folder, from the shard index when there is one."""
    index = folder / INDEX_FILE
    if index.is_file():
        with load_errors_named(index):
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelLoadError("has no weight_map")
            if not all(isinstance(name, str) and "/" not in name for name in weight_map.values()):
                raise ModelLoadError("weight_map must name shard files of this folder")
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ValueError(f"{folder} holds only pickled weights (*.bin / *.pt), which pagedgen does "
                         "not load (unpickling can run code). Convert them to safetensors first.")
    raise ValueError(f"{folder} has no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file")


def open_safetensors(folder: Path) -> list[Path]:
    """The weight files, each header read and checked (a truncated or garbage file is named
    here, before anything is allocated for the model)."""
    files = safetensors_files(folder)
    for path in files:
        if not path.is_file():
            raise ModelLoadError(f"shard {path.name} listed in {INDEX_FILE} is missing", folder)
        with load_errors_named(path):
            safe_open(path, framework="pt").keys()
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, one at a time (memory-mapped)."""
    for path in safetensors_files(folder):
        if not path.is_file():
            raise ValueError(f"shard {path.name} listed in {INDEX_FILE} is missing from {folder}")
        with load_errors_named(path):   # truncated or garbage files: safetensors' own errors
            reader = safe_open(path, framework="pt")
            names = list(reader.keys())
        for name in names:
            with load_errors_named(path):
                tensor = reader.get_tensor(name)
            yield name, tensor   # outside: the consumer's errors are not this file's
