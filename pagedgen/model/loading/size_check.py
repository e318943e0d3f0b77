"""Does a config fit the weight files next to it? Checked before the decoder is allocated.

The decoder's storage is allocated from the config, and only then filled from the files. A
config saying vocab_size=10^12 (a corrupt or mismatched config.json, a hand-made GGUF header)
would make that allocation fail with a MemoryError, or succeed lazily and get the process
killed. Every weight must come from the files, each taking at least a minimum number of
bytes there, so the files' size bounds what a genuine config can describe.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pagedgen.model.config import ModelConfig
from pagedgen.model.errors import ModelLoadError

SAFETENSORS_MIN_BYTES_PER_WEIGHT = 1.0    # 8-bit types (I8, U8, F8_*) are safetensors' smallest
GGUF_MIN_BYTES_PER_WEIGHT = 1.5 / 8       # ggml's smallest types store ~1.56 bits per weight


def weight_count(config: ModelConfig) -> int:
    """Weights the files must hold at least: the embedding and every layer (the LM head may be
    tied to the embedding; norms and biases are too small to matter for the bound)."""
    hidden = config.hidden_size
    attention = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden
    mlp = 3 * hidden * config.intermediate_size
    return config.vocab_size * hidden + config.num_layers * (attention + mlp)


def check_config_fits_files(config: ModelConfig, files: Iterable[Path],
                            min_bytes_per_weight: float, config_file: Path) -> None:
    held = sum(path.stat().st_size for path in files)
    needed = int(weight_count(config) * min_bytes_per_weight)
    if needed > held:
        raise ModelLoadError(
            f"the config describes {weight_count(config):,} weights (vocab_size="
            f"{config.vocab_size}, hidden_size={config.hidden_size}, num_layers="
            f"{config.num_layers}), which need at least {needed:,} bytes, but the weight files "
            f"hold {held:,}: the config does not belong to these weights", config_file)
