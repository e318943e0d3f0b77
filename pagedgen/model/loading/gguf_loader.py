"""Single-file GGUF models (llama.cpp's format): config, weights and EOS ids.

The container is read by gguf_file.read_gguf (fast, skips the vocabulary strings); tensors
are dequantized to float32 with gguf.quants.dequantize (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q4_K, Q6_K and the other types it knows), renamed to transformers' names, and, for
llama-architecture files, Q/K rows are put back in transformers' order: llama.cpp's converter
permutes them to suit its own RoPE layout.

gemma3 files: llama.cpp's converter stores every Gemma norm weight as 1 + w (its RMSNorm
multiplies by the weight), transformers' Gemma3RMSNorm multiplies by 1 + w: the 1 is taken
off again here. What the file does not say, llama.cpp and transformers both take from
Gemma 3's fixed design: local RoPE base 10k, every 6th layer global, query_pre_attn_scalar
= head_dim (GEMMA3_FIXED).
"""
from __future__ import annotations

import struct
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize

from pagedgen.model.config import (FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig,
                                   UnsupportedModelError)
from pagedgen.model.errors import ModelLoadError
from pagedgen.model.loading.gguf_file import GgufFile, GgufTensor, read_gguf

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
GEMMA3_FIXED = {"local_rope_theta": 10_000.0, "sliding_window_pattern": 6}
# Gemma 3 27B (62 layers) scales queries by (hidden / heads) ** -0.5, every other size by
# head_dim ** -0.5: llama.cpp's rule, and the query_pre_attn_scalar of Google's configs.
GEMMA3_27B_LAYERS = 62
# Architectures whose norm weights llama.cpp stores as 1 + w.
OFFSET_NORM_ARCHITECTURES = ("gemma3",)
# llama.cpp's converter permutes Q/K only for these (the others use NeoX-style RoPE there too).
PERMUTED_QK_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # Gemma's sandwich norms: in its files ffn_norm is the MLP's input norm (see _hf_layer_name).
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 files: rope scaling stored as per-frequency factors


def open_gguf(path: Path) -> GgufFile:
    try:
        return read_gguf(path)
    except (ValueError, OSError, struct.error) as error:  # struct.error: a truncated header
        raise ModelLoadError(f"cannot read GGUF file: {error}", path) from error


def field(reader: GgufFile, key: str, default=None):
    return reader.metadata.get(key, default)


def gguf_architecture(reader: GgufFile) -> str:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF general.architecture={arch!r} is not supported; "
                                    f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    return arch


def gguf_model_config(reader: GgufFile) -> ModelConfig:
    arch = gguf_architecture(reader)
    names = {t.name for t in reader.tensors}

    def required(key: str) -> int:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise UnsupportedModelError(f"GGUF file lacks the metadata field {arch}.{key}")
        return int(value)

    hidden, heads = required("embedding_length"), required("attention.head_count")
    embed = reader.tensor("token_embd.weight")
    if embed is None:
        raise UnsupportedModelError(f"GGUF file {reader.path} has no token_embd.weight tensor")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(embed.shape[0]),
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_layers=required("block_count"),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", _per_head(hidden, heads))),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        max_position_embeddings=required("context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        attention_output_bias="blk.0.attn_output.bias" in names,
        **(_gemma3_fields(reader, required("block_count")) if arch == "gemma3" else {}),
    )


def _gemma3_fields(reader: GgufFile, layers: int) -> dict:
    """Gemma 3's window, layer pattern, local RoPE and activation (see the module docstring)."""
    pattern = GEMMA3_FIXED["sliding_window_pattern"]
    window = field(reader, "gemma3.attention.sliding_window")
    if window is None:
        raise UnsupportedModelError("GGUF file lacks the metadata field gemma3.attention.sliding_window")
    types = tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers))
    hidden, heads = field(reader, "gemma3.embedding_length"), field(reader, "gemma3.attention.head_count")
    head_dim = field(reader, "gemma3.attention.key_length", _per_head(int(hidden), int(heads)))
    scalar = _per_head(int(hidden), int(heads)) if layers == GEMMA3_27B_LAYERS else int(head_dim)
    return {"hidden_act": "gelu_pytorch_tanh", "sliding_window": int(window), "layer_types": types,
            "sliding_rope_theta": GEMMA3_FIXED["local_rope_theta"],
            "query_pre_attn_scalar": float(scalar)}


def _per_head(hidden: int, heads: int) -> int:
    return hidden // heads if heads > 0 else 0   # 0: ModelConfig names the bad head count


def _rope_scaling(reader: GgufFile, arch: str) -> dict | None:
    freqs = reader.tensor(ROPE_FREQS)
    if freqs is not None:
        return {"rope_type": "freq_factors", "freq_factors": _to_numpy(freqs).tolist()}
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field(reader, f"{arch}.rope.scaling.factor"))}
    raise UnsupportedModelError(f"GGUF {arch}.rope.scaling.type={kind!r} is not supported")


def gguf_eos_token_ids(reader: GgufFile) -> list[int]:
    """End-of-generation ids the file declares (EOS, and end-of-turn / end-of-message)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [field(reader, key) for key in keys]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def iter_gguf_tensors(reader: GgufFile, config: ModelConfig,
                      skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, float32 tensor) for every weight, Q/K rows un-permuted; names in
    `skip` (weights kept packed: gguf_packed.py) are left out, never dequantized."""
    arch = gguf_architecture(reader)
    permuted = arch in PERMUTED_QK_ARCHITECTURES
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # folded into config.rope_scaling
        name = hf_tensor_name(tensor.name, arch)
        if name in skip:
            continue
        weights = _to_numpy(tensor)
        if arch in OFFSET_NORM_ARCHITECTURES and name.endswith("norm.weight"):
            weights -= 1.0  # float32 already: the same rounding as transformers' weights - 1
        if permuted and ".self_attn.q_proj." in name:
            weights = unpermute_qk(weights, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            weights = unpermute_qk(weights, config.num_kv_heads)
        yield name, torch.from_numpy(weights)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.<i>.<kind>.<weight|bias>
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} is not part of a supported model")
    module = _LAYER_NAMES[parts[2]]
    if arch == "gemma3" and parts[2] == "ffn_norm":
        module = "pre_feedforward_layernorm"
    return f"model.layers.{parts[1]}.{module}.{parts[3]}"


def unpermute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute: within each head, rows were reordered from halves to pairs."""
    rows = weights.shape[0]
    rest = weights.shape[1:]
    grouped = weights.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weights.shape)


def dequantize_tensor(data: np.ndarray, tensor_type) -> np.ndarray:
    """float32 array in torch's dimension order, writable (so torch can wrap it)."""
    values = dequantize(data, tensor_type)
    if values.dtype != np.float32 or not values.flags.writeable:
        values = np.array(values, dtype=np.float32)
    return values


def _to_numpy(tensor: GgufTensor) -> np.ndarray:
    return dequantize_tensor(tensor.data, tensor.tensor_type)
