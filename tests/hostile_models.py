"""Model files a user might really have on disk, broken in the ways downloads and hand edits
break them: builders for the load-failure tests (nothing downloaded, all built at test time).

Import as `hostile_models` (conftest puts tests/ on sys.path).
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from tiny_models import gguf_name, hf_config, tiny_hf_model, tiny_model_dir, tiny_tokenizer


def copy_model_folder(destination: Path, arch: str = "llama") -> Path:
    shutil.copytree(tiny_model_dir(arch), destination)
    return destination


def write_llama_header(writer: GGUFWriter, config) -> None:
    """The llama.* keys a GGUF of the tiny model needs, from its transformers config."""
    for key, value in (("block_count", config.num_hidden_layers), ("context_length", 512),
                       ("embedding_length", config.hidden_size),
                       ("feed_forward_length", config.intermediate_size),
                       ("attention.head_count", config.num_attention_heads),
                       ("attention.head_count_kv", config.num_key_value_heads)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", config.rms_norm_eps)


def tiny_gguf_with_tokenizer(path: Path, embed_tokenizer: bool = True) -> Path:
    """A llama GGUF of the tiny model with the tiny tokenizer embedded (BPE, 'gpt2' model).
    Q/K are not permuted: these files test loading, not numerics."""
    config, tokenizer = hf_config("llama"), tiny_tokenizer()
    writer = GGUFWriter(path, "llama")
    write_llama_header(writer, config)
    if embed_tokenizer:
        _embed_tokenizer(writer, tokenizer)
    for name, tensor in tiny_hf_model("llama").state_dict().items():
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(tensor.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _embed_tokenizer(writer: GGUFWriter, tokenizer) -> None:
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(backend["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in tokenizer.all_special_tokens else 1 for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_bos_token_id(tokenizer.bos_token_id)


# --- hand-made GGUF headers ---------------------------------------------------------------

def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_header(metadata: list[bytes], tensors: list[bytes], version: int = 3,
                tensor_count: int | None = None, kv_count: int | None = None) -> bytes:
    """GGUF bytes from pre-encoded metadata entries and tensor infos (counts may lie)."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if tensor_count is None else tensor_count,
                                 len(metadata) if kv_count is None else kv_count)
    return head + b"".join(metadata) + b"".join(tensors)


def kv_uint32(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<II", GGUFValueType.UINT32, value)


def kv_string(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", GGUFValueType.STRING) + _string(value)


def kv_nested_arrays(key: str, depth: int) -> bytes:
    """key = [[[...[]...]]], `depth` arrays deep (each holding one array, the last none)."""
    body = struct.pack("<IQ", GGUFValueType.ARRAY, 1) * (depth - 1) + struct.pack("<IQ", GGUFValueType.UINT8, 0)
    return _string(key) + struct.pack("<I", GGUFValueType.ARRAY) + body


def tensor_info(name: str, shape: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    """ggml order: fastest dimension first (the reader reverses it)."""
    return (_string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
            + struct.pack("<IQ", ggml_type, offset))
