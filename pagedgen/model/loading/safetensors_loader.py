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
from pagedgen.model.loading.hf_config import model_config_from_hf

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_hf_config(folder: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, the raw config.json mapping)."""
    config_path = folder / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {config_path}: {error}") from error
    return model_config_from_hf(raw), raw


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of the folder, from the shard index when there is one."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
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


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, one at a time (memory-mapped)."""
    for path in safetensors_files(folder):
        if not path.is_file():
            raise ValueError(f"shard {path.name} listed in {INDEX_FILE} is missing from {folder}")
        with safe_open(path, framework="pt") as reader:
            for name in reader.keys():
                yield name, reader.get_tensor(name)
