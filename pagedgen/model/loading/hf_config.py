"""config.json (a plain dict) -> ModelConfig, accepting transformers 4.x and 5.x spellings.

Gemma 3: Gemma3ForCausalLM folders (a Gemma3TextConfig), and the text part of
Gemma3ForConditionalGeneration folders (the decoder's numbers in a nested text_config).
"""
from __future__ import annotations

from typing import Any

from pagedgen.model.config import (
    FULL_ATTENTION,
    MODEL_TYPE_TO_ARCHITECTURE,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
)

DEFAULT_ROPE_THETA = 10000.0
GEMMA3 = "Gemma3ForCausalLM"
# Multimodal Gemma 3: only its text decoder is run (weights under language_model.).
TEXT_PART_OF = {"Gemma3ForConditionalGeneration": GEMMA3}
# Gemma 3's defaults, as Gemma3TextConfig fills them when config.json leaves them out (the
# multimodal folders' text_config often lists only what differs from them).
GEMMA3_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                   "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                   "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
                   "query_pre_attn_scalar": 256,
                   "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                   "sliding_window": 4096, "sliding_window_pattern": 6, "tie_word_embeddings": True,
                   "max_position_embeddings": 131_072, "head_dim": 256}


def model_config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    raw = text_config(raw)
    architecture = _architecture(raw)
    if architecture == GEMMA3:
        raw = {**GEMMA3_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
        _reject_gemma_features(raw)
    _reject_unsupported_features(architecture, raw)
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
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        # Missing means "untied" here; the loader also ties when the file has no lm_head.
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bias,
        qk_norm=architecture in ("Qwen3ForCausalLM", GEMMA3),
        attention_output_bias=bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM",
                                                        GEMMA3),
        hidden_act=_activation(raw),
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if architecture == GEMMA3 else None,
        **_windows(architecture, raw),
        **(_gemma_local_rope(raw) if architecture == GEMMA3 else {}),
    )


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a multimodal folder's text_config, with its text architecture."""
    listed = raw.get("architectures") or []
    if listed and listed[0] in TEXT_PART_OF:
        nested = raw.get("text_config")
        if not isinstance(nested, dict):
            raise UnsupportedModelError(f"config.json architectures={listed} needs a text_config "
                                        "object holding the text decoder's settings")
        return {**nested, "architectures": [TEXT_PART_OF[listed[0]]]}
    return raw


def _windows(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types, as transformers derives them for each family."""
    layers = raw.get("num_hidden_layers")
    window = raw.get("sliding_window")
    if architecture == GEMMA3:
        types = raw.get("layer_types") or _gemma_pattern(layers, raw["sliding_window_pattern"])
    elif architecture == "MistralForCausalLM":  # no flag: the window is on whenever it is set
        types = [SLIDING_ATTENTION] * layers if window and isinstance(layers, int) else []
    elif architecture == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
        types = raw.get("layer_types") or _sliding_from(layers, raw.get("max_window_layers", 28))
    else:
        types = []
    if set(types) <= {FULL_ATTENTION}:  # (anything unknown goes on, for ModelConfig to name)
        return {}
    return {"sliding_window": window, "layer_types": tuple(types)}


def _gemma_pattern(layers: Any, pattern: Any) -> list[str]:
    """Every pattern-th layer global, the others sliding (Gemma3TextConfig's rule)."""
    if not isinstance(layers, int) or not isinstance(pattern, int) or pattern <= 0:
        return []
    return [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]


def _sliding_from(layers: Any, first: Any) -> list[str]:
    """Qwen2: layers from max_window_layers on slide."""
    if not isinstance(layers, int) or not isinstance(first, int):
        return []
    return [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]


def _gemma_local_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """RoPE of Gemma 3's sliding layers: 5.x rope_parameters["sliding_attention"], 4.x
    rope_local_base_freq (never scaled: 4.x's rope_scaling is the global layers' only)."""
    params = raw.get("rope_parameters") or {}
    local = params.get(SLIDING_ATTENTION) if isinstance(params, dict) else None
    if isinstance(local, dict):
        local = dict(local)
        theta = float(local.pop("rope_theta", raw["rope_local_base_freq"]))
        rope_type = local.pop("rope_type", local.pop("type", "default"))
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **local}
        return {"sliding_rope_theta": theta, "sliding_rope_scaling": scaling}
    return {"sliding_rope_theta": float(raw["rope_local_base_freq"])}


def _reject_gemma_features(raw: dict[str, Any]) -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise UnsupportedModelError(f"config.json {key}={raw[key]!r} is not supported "
                                        "(Gemma 3 has no soft-capping)")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("config.json use_bidirectional_attention=true is not supported")


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


def _activation(raw: dict[str, Any]) -> Any:
    return raw.get("hidden_activation") or raw.get("hidden_act") or "silu"


def _reject_unsupported_features(architecture: str, raw: dict[str, Any]) -> None:
    act = _activation(raw)
    if act != "silu" and architecture != GEMMA3:
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
    """(theta, scaling or None). 5.x: rope_parameters holds both; 4.x: split in two keys.
    Per-layer-kind rope_parameters (Gemma 3): the full-attention layers' entry."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(params.get(FULL_ATTENTION), dict):
        params = params[FULL_ATTENTION]
    params = dict(params)
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
