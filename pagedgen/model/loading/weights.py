"""Copy checkpoint tensors (transformers' names) into Decoder's fused parameters.

q/k/v land in row ranges of one qkv weight and gate/up in one gate_up weight, which is what
lets the decoder run one GEMM for each. Every parameter must be written exactly once;
anything missing or unknown is an error that names the tensor.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedgen.model.errors import ModelLoadError
from pagedgen.model.layers.decoder import Decoder

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints saved this buffer
# Multimodal checkpoints (Gemma3ForConditionalGeneration): only the text decoder is loaded.
_IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")
# Where the text decoder's tensors live in them (4.x and 5.x layouts) -> the text model's names.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


class WeightLoadError(ModelLoadError):
    """A checkpoint does not match the model its config describes."""


def load_weights(model: Decoder, tensors: Iterable[tuple[str, torch.Tensor]],
                 provided: Iterable[str] = ()) -> None:
    """Fill every parameter of `model` from (hf_name, tensor) pairs, converting dtype on copy;
    `provided`: names already served another way (GGUF matrices kept packed)."""
    targets = _targets(model)
    filled: set[str] = set(provided)
    saw_lm_head = "lm_head.weight" in filled
    for raw_name, tensor in tensors:
        if raw_name.startswith(_IGNORED_PREFIXES):
            continue
        name = normalize_name(raw_name)
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        saw_lm_head |= name == "lm_head.weight"
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied models may still ship a copy; the embedding is the one used
        if name not in targets:
            raise WeightLoadError(f"checkpoint tensor {name!r} has no place in a "
                                  f"{model.config.architecture} with this config")
        _copy_into(name, tensor, *targets[name])
        filled.add(name)
    if not saw_lm_head and not model.config.tie_word_embeddings:
        model.tie_lm_head()  # no lm_head in the file: the embedding doubles as the head
        filled.add("lm_head.weight")
    _check_complete(targets, filled)


def _copy_into(name: str, tensor: torch.Tensor, destination: torch.Tensor, rows: slice) -> None:
    view = destination[rows]
    if name.endswith(("q_norm.weight", "k_norm.weight")) and tensor.shape == view.shape[1:]:
        tensor = tensor.expand_as(view)  # one [D] weight shared by every head's row
    if tuple(tensor.shape) != tuple(view.shape):
        raise WeightLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                              f"the config implies {tuple(view.shape)}")
    with torch.no_grad():
        view.copy_(tensor)


def _check_complete(targets: dict, filled: set[str]) -> None:
    missing = sorted(set(targets) - filled)
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise WeightLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def _targets(model: Decoder) -> dict[str, tuple[torch.Tensor, slice]]:
    """hf_name -> (destination parameter, row range inside it)."""
    targets = {"model.embed_tokens.weight": (model.embed_weight, slice(None)),
               "model.norm.weight": (model.norm.weight, slice(None))}
    if not model.config.tie_word_embeddings:
        targets["lm_head.weight"] = (model.lm_head_weight, slice(None))
    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}."
        targets.update({prefix + key: value for key, value in _layer_targets(model, layer).items()})
    return targets


def _layer_targets(model: Decoder, layer) -> dict[str, tuple[torch.Tensor, slice]]:
    cfg, attn, mlp = model.config, layer.attention, layer.mlp
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    targets = {
        "input_layernorm.weight": (layer.input_norm.weight, slice(None)),
        "self_attn.o_proj.weight": (attn.o_weight, slice(None)),
        "mlp.gate_proj.weight": (mlp.gate_up_weight, slice(0, inter)),
        "mlp.up_proj.weight": (mlp.gate_up_weight, slice(inter, 2 * inter)),
        "mlp.down_proj.weight": (mlp.down_weight, slice(None)),
        **_norm_targets(layer),
    }
    for proj, row_range in rows.items():
        targets[f"self_attn.{proj}.weight"] = (attn.qkv_weight, row_range)
        if attn.qkv_bias is not None:
            targets[f"self_attn.{proj}.bias"] = (attn.qkv_bias, row_range)
    if attn.o_bias is not None:
        targets["self_attn.o_proj.bias"] = (attn.o_bias, slice(None))
    if attn.qk_norm_weight is not None:
        heads = cfg.num_heads
        targets["self_attn.q_norm.weight"] = (attn.qk_norm_weight, slice(0, heads))
        targets["self_attn.k_norm.weight"] = (attn.qk_norm_weight, slice(heads, None))
    return targets


def _norm_targets(layer) -> dict[str, tuple[torch.Tensor, slice]]:
    """transformers' names of the norms around the MLP. Llama's post_attention_layernorm is
    the MLP's input norm; with sandwich norms (Gemma) it norms the attention output and
    pre_feedforward_layernorm is the MLP's input norm."""
    whole = slice(None)
    if layer.attention_out_norm is None:
        return {"post_attention_layernorm.weight": (layer.post_attention_norm.weight, whole)}
    return {"post_attention_layernorm.weight": (layer.attention_out_norm.weight, whole),
            "pre_feedforward_layernorm.weight": (layer.post_attention_norm.weight, whole),
            "post_feedforward_layernorm.weight": (layer.mlp_out_norm.weight, whole)}


def normalize_name(name: str) -> str:
    """Accept checkpoints saved without the leading 'model.' of the decoder body, and the
    text decoder's names inside a multimodal checkpoint."""
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    if name.startswith(("model.", "lm_head.")):
        return name
    return "model." + name
