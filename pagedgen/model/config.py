"""ModelConfig: the handful of numbers the decoder needs, read robustly from config.json.

How a family's layers differ from Llama's is data (ARCHITECTURE_STYLES: norm style,
sandwich norms, scaled embeddings), and so is which layers slide (layer_types) and which RoPE
each layer uses (rope_of): a new family is a table entry, not branches through the layers.

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
from pagedgen.settings import default

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
# model_type -> architecture, for configs that omit "architectures" (and for GGUF files).
MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# "freq_factors" is internal: llama.cpp files store Llama 3 scaling as a rope_freqs tensor.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # transformers' names
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gate activation of the gated MLP


@dataclass(frozen=True, slots=True)
class ArchitectureStyle:
    """How one family's decoder layer is built, beyond the numbers of its config."""

    # "llama": normalise in float32, cast to the model dtype, then x * w.
    # "gemma": x * (1 + w) computed in float32, then cast (w is stored centred on 0).
    norm: str = "llama"
    # Gemma 2/3: RMSNorm also on the attention output and on the MLP output, before each is
    # added to the residual stream (transformers' post_attention / post_feedforward norms).
    sandwich_norms: bool = False
    # Gemma: embeddings multiplied by sqrt(hidden_size) rounded to the weight dtype.
    scaled_embedding: bool = False


LLAMA_STYLE = ArchitectureStyle()
ARCHITECTURE_STYLES = {
    "LlamaForCausalLM": LLAMA_STYLE,
    "MistralForCausalLM": LLAMA_STYLE,
    "Qwen2ForCausalLM": LLAMA_STYLE,
    "Qwen3ForCausalLM": LLAMA_STYLE,
    "Gemma3ForCausalLM": ArchitectureStyle(norm="gemma", sandwich_norms=True, scaled_embedding=True),
}


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
    hidden_act: str = "silu"  # the MLP gate's activation (one of ACTIVATIONS)
    # Attention scale is query_pre_attn_scalar ** -0.5 where set (Gemma), else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Keys a sliding layer's query at position p sees: positions in (p - sliding_window, p].
    sliding_window: int | None = None
    # Per layer FULL_ATTENTION or SLIDING_ATTENTION; empty means every layer full attention.
    layer_types: tuple[str, ...] = ()
    # RoPE of the sliding layers where it differs from the full layers' (Gemma 3: base 10k
    # local, 1M global, and only the global layers scaled); None: the same RoPE everywhere.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.layer_types = tuple(self.layer_types)
        _validate(self)

    @property
    def style(self) -> ArchitectureStyle:
        return ARCHITECTURE_STYLES[self.architecture]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer: int) -> int:
        """The sliding window of `layer`, 0 for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return int(self.sliding_window)
        return 0

    def rope_of(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling or None) of the RoPE `layer` applies."""
        if self.window_of(layer) and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype | str,
                           kv_cache_dtype: str = default("kv_cache_dtype"),
                           block_size: int = default("block_size")) -> int:
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
    for scaling in (cfg.rope_scaling, cfg.sliding_rope_scaling):
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; supported: "
                                        f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    _validate_attention_kinds(cfg)


def _validate_attention_kinds(cfg: ModelConfig) -> None:
    if cfg.hidden_act not in ACTIVATIONS:
        raise UnsupportedModelError(f"config field hidden_act={cfg.hidden_act!r} is not supported; "
                                    f"supported: {', '.join(ACTIVATIONS)}")
    if cfg.layer_types and len(cfg.layer_types) != cfg.num_layers:
        raise UnsupportedModelError(f"config field layer_types has {len(cfg.layer_types)} entries "
                                    f"for {cfg.num_layers} layers")
    unknown = set(cfg.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown:
        raise UnsupportedModelError(f"config field layer_types holds {sorted(unknown)}; supported: "
                                    f"{FULL_ATTENTION}, {SLIDING_ATTENTION}")
    if SLIDING_ATTENTION in cfg.layer_types:
        window = cfg.sliding_window
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise UnsupportedModelError(f"config field sliding_window must be a positive integer "
                                        f"for sliding layers, got {_shown(window)}")
    for name in ("query_pre_attn_scalar", "sliding_rope_theta"):
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value) or value <= 0):
            raise UnsupportedModelError(f"config field {name} must be a positive finite number, "
                                        f"got {_shown(value)}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
