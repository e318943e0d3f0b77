"""config.json (a plain dict) -> ModelConfig, accepting transformers 4.x and 5.x spellings."""
from __future__ import annotations

from typing import Any

from pagedgen.model.config import (
    MODEL_TYPE_TO_ARCHITECTURE,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
    usable_context,
)

DEFAULT_ROPE_THETA = 10000.0


def model_config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    architecture = _architecture(raw)
    _reject_unsupported_features(raw)
    num_heads = _required(raw, "num_attention_heads")
    hidden_size = _required(raw, "hidden_size")
    rope_theta, rope_scaling = _rope(raw)
    bias = _attention_bias(architecture, raw)
    return ModelConfig(
        architecture=architecture,
        vocab_size=_required(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_required(raw, "intermediate_size"),
        num_layers=_required(raw, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or _per_head(hidden_size, num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_max_positions(raw),
        # Missing means "untied" here; the loader also ties when the file has no lm_head.
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bias,
        qk_norm=architecture == "Qwen3ForCausalLM",
        attention_output_bias=bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
    )


def _per_head(hidden_size: Any, num_heads: Any) -> Any:
    """hidden / heads, or the bad value itself for ModelConfig's check to name."""
    if not isinstance(num_heads, int) or num_heads <= 0:
        return num_heads
    return hidden_size // num_heads if isinstance(hidden_size, int) else hidden_size


def _architecture(raw: dict[str, Any]) -> str:
    listed = raw.get("architectures") or []
    if listed:
        if listed[0] not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"config.json architectures={listed} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        return listed[0]
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPE_TO_ARCHITECTURE:
        raise UnsupportedModelError(
            f"config.json model_type={model_type!r} is not supported; supported: "
            f"{', '.join(MODEL_TYPE_TO_ARCHITECTURE)}")
    return MODEL_TYPE_TO_ARCHITECTURE[model_type]


def _reject_unsupported_features(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise UnsupportedModelError(f"config.json hidden_act={act!r} is not supported; only 'silu'")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("config.json mlp_bias=true is not supported")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("config.json partial_rotary_factor != 1 is not supported")


def _required(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise UnsupportedModelError(f"config.json is missing the required field {key!r}")
    return raw[key]


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None). 5.x: rope_parameters holds both; 4.x: split in two keys."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _attention_bias(architecture: str, raw: dict[str, Any]) -> bool:
    if architecture == "Qwen2ForCausalLM":  # always has q/k/v bias, no flag in its config
        return True
    if architecture == "MistralForCausalLM":
        return False
    return bool(raw.get("attention_bias", False))


def _max_positions(raw: dict[str, Any]) -> int:
    # Mistral's config has no use_sliding_window flag: its window is always on.
    uses_window = raw.get("use_sliding_window", raw.get("model_type") == "mistral")
    window = raw.get("sliding_window") if uses_window else None
    return usable_context(raw.get("max_position_embeddings", 2048), window)
