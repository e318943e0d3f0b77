"""ModelConfig: the handful of numbers the decoder needs, read robustly from config.json.

transformers 5.x writes rope settings as ``rope_parameters`` ({"rope_type", "rope_theta", ...});
4.x wrote ``rope_theta`` at the top level and ``rope_scaling`` ({"type" or "rope_type", ...}).
Both spellings are accepted here so that folders saved by either version load.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pagedgen.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# model_type -> architecture, for configs that omit "architectures" (and for GGUF files).
MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# "freq_factors" is internal: llama.cpp files store Llama 3 scaling as a rope_freqs tensor.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def usable_context(max_positions: int, sliding_window: int | None) -> int:
    """Longest context the model is run at: its positions, capped by a sliding window if any.

    The paged kernels implement full causal attention. A sliding-window model (Mistral v0.1,
    Qwen with use_sliding_window) computes exactly the same thing while the context fits in
    the window, so the window caps the usable length instead of giving wrong answers beyond it.
    """
    limit = int(max_positions)
    return min(limit, int(sliding_window)) if sliding_window else limit


class UnsupportedModelError(ModelLoadError):
    """The checkpoint describes a model this runtime cannot run; the message says why."""


# Upper bounds far above every released model (largest vocabularies ~260k, longest contexts
# ~10M positions), so that an absurd config value is refused before anything is allocated
# for it (the RoPE table alone is max_position_embeddings x head_dim floats).
FIELD_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
                "num_layers": 1024, "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 1024,
                "max_position_embeddings": 1 << 24}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": "linear" | "llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q, k and v projections (Qwen2 always has it)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    attention_output_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype | str, kv_cache_dtype: str = "auto",
                           block_size: int = 16) -> int:
        """Bytes of K and V one token occupies across all layers in a cache of `dtype`
        (or of a quantized kv_cache_dtype, its share of the block's scales included)."""
        from pagedgen.model.runtime.kv_cache import kv_bytes_per_token

        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype,
                                  kv_cache_dtype, block_size)


def _validate(cfg: ModelConfig) -> None:
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {cfg.architecture!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    for name, limit in FIELD_LIMITS.items():
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UnsupportedModelError(f"config field {name} must be a positive integer, "
                                        f"got {_shown(value)}")
        if value > limit:
            raise UnsupportedModelError(f"config field {name}={value} is beyond any real model "
                                        f"(at most {limit}); the config is corrupt")
    for name in ("rms_norm_eps", "rope_theta"):
        value = getattr(cfg, name)
        if not isinstance(value, float) or not math.isfinite(value) or value <= 0:
            raise UnsupportedModelError(f"config field {name} must be a positive finite number, "
                                        f"got {_shown(value)}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise UnsupportedModelError(
            f"num_heads ({cfg.num_heads}) must be a multiple of num_kv_heads ({cfg.num_kv_heads})")
    if cfg.head_dim % 2:
        raise UnsupportedModelError(f"head_dim must be even for RoPE, got {cfg.head_dim}")
    rope_type = (cfg.rope_scaling or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
