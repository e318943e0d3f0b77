"""Where a model lives and what its config says, without reading any weights.

One resolution for everyone: `load_model` and `inspect-memory` both go through `locate_model`
and `read_model_config`, so the sizing arithmetic sees exactly the ModelConfig the loader
builds (sliding-window cap included) and the two can never disagree.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pagedgen.model.config import ModelConfig
from pagedgen.model.errors import load_errors_named
from pagedgen.model.loading.default_model import DEFAULT_MODEL_NAME, default_model_path
from pagedgen.model.loading.safetensors_loader import is_hf_folder, read_hf_config


@dataclass(slots=True)
class ModelSource:
    kind: Literal["hf", "gguf"]   # an HF folder (config.json + safetensors) or one GGUF file
    path: Path
    name: str                     # what reports and OpenAI batch answers call the model


def locate_model(model: str | Path | None) -> ModelSource:
    """model: None (the built-in default), an HF folder, a .gguf file or a folder holding one."""
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if is_hf_folder(path):
        return ModelSource("hf", path, path.name)
    gguf_file = _single_gguf(path)
    if gguf_file is not None:
        return ModelSource("gguf", gguf_file, gguf_file.name)
    raise ValueError(_not_found_message(str(model)))


def _not_found_message(model: str) -> str:
    """What to do instead: a hub id gets the command that downloads it, and what runs."""
    from pagedgen.model.config import SUPPORTED_ARCHITECTURES

    runs = f"architectures that run: {', '.join(SUPPORTED_ARCHITECTURES)} (HF folders), GGUF files"
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if looks_like_hub_id and not Path(model).exists():
        local = f"models/{model.split('/')[1]}"
        # One line: callers print load errors on one line, so the command sits in quotes.
        return (f"model {model!r} is not a local folder or .gguf file, and pagedgen does not "
                f"download (it runs offline). Download it once with "
                f"'hf download {model} --local-dir {local}', then pass --model {local} ({runs})")
    return f"model {model!r} is neither a folder with config.json nor a .gguf file ({runs})"


def _single_gguf(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"model folder {path} holds several .gguf files; pass one of them: "
                             f"{[p.name for p in found]}")
        return found[0] if found else None
    return None


def read_model_config(source: ModelSource) -> ModelConfig:
    """The ModelConfig the loader would build (config.json, or the GGUF header and tensor list)."""
    with load_errors_named(source.path):
        if source.kind == "hf":
            return read_hf_config(source.path)[0]
        from pagedgen.model.loading.gguf_loader import gguf_model_config, open_gguf

        return gguf_model_config(open_gguf(source.path))
