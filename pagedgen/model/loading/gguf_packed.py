"""Load a GGUF model with its matrices left in the file's packed blocks (weights="packed").

The file stays memory-mapped (gguf_file.read_gguf): each projection, the embedding table and
the LM head become QuantizedWeight views of the mapped bytes, so resident weight memory is
the file's pages that are touched, not a dequantized copy. Nothing is repacked: the kernels
read every supported type in its stored layout, the fused q/k/v and gate/up projections are
several parts of one QuantizedWeight (written into column slices of one output), and
llama.cpp's permuted Q/K rows are read through a row map instead of being reordered.

Tensors that are not matrices of a supported type (norms, biases, F32/F16 matrices, or a
fused group with one unsupported member) are dequantized into the model's dtype as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedgen.kernels.cpu import gguf as gguf_kernels
from pagedgen.model.config import ModelConfig
from pagedgen.model.layers.linear import pack_releasing, placeholder_like
from pagedgen.model.layers.decoder import Decoder
from pagedgen.model.layers.quantized_linear import QuantizedPart, QuantizedWeight
from pagedgen.model.loading import gguf_loader
from pagedgen.model.loading.gguf_file import GgufFile, GgufTensor
from pagedgen.model.loading.weights import load_weights

# (module attribute, weight attribute, packed attribute, GGUF kinds of its parts in row order)
_LAYER_GROUPS = (("attention", "qkv_weight", "qkv_packed", ("attn_q", "attn_k", "attn_v")),
                 ("attention", "o_weight", "o_packed", ("attn_output",)),
                 ("mlp", "gate_up_weight", "gate_up_packed", ("ffn_gate", "ffn_up")),
                 ("mlp", "down_weight", "down_packed", ("ffn_down",)))


@dataclass(slots=True)
class PackedGguf:
    """The packed weights of one model, installed by Decoder.pack_weights()."""

    layers: list[dict[str, QuantizedWeight]]  # per layer: packed attribute -> weight
    embedding: QuantizedWeight | None
    lm_head: QuantizedWeight | None
    library: gguf_kernels.GgufLibrary
    hf_names: set[str] = field(default_factory=set)  # tensors these weights stand for

    @property
    def stored_bytes(self) -> int:
        weights = [w for layer in self.layers for w in layer.values()]
        weights += [w for w in (self.embedding, self.lm_head) if w is not None]
        unique = {id(w): w for w in weights}  # a tied head is the embedding itself
        return sum(w.stored_bytes for w in unique.values())

    def install(self, decoder: Decoder, batch_invariant: bool) -> None:
        """Set every projection's `*_packed`: the quantized weight where there is one, else the
        dense packing. No fused decode step: its C kernel reads bf16-packed weights only."""
        for layer, packed in zip(decoder.layers, self.layers):
            for module_name, weight_name, packed_name, _ in _LAYER_GROUPS:
                module = getattr(layer, module_name)
                quantized = packed.get(packed_name)
                setattr(module, packed_name,
                        quantized.with_invariance(batch_invariant) if quantized is not None
                        else pack_releasing(module, weight_name, getattr(module, packed_name),
                                            batch_invariant))
        decoder.lm_head_packed = (self.lm_head.with_invariance(batch_invariant) if self.lm_head
                                  else decoder.pack_lm_head(batch_invariant))
        decoder.fused_decode = None


def packed_kernels_available() -> gguf_kernels.GgufLibrary | None:
    return gguf_kernels.best()


def fast_packed_kernels() -> bool:
    """Whether this CPU's GGUF library decodes weight blocks in registers (AVX2, AVX-512): the
    portable library's tile path, the only one elsewhere (ARM, ...), decodes slower than a
    dequantized model runs."""
    library = gguf_kernels.best()
    return library is not None and library.path != "portable"


def build_packed_decoder(config: ModelConfig, reader: GgufFile, dtype: torch.dtype,
                         library: gguf_kernels.GgufLibrary) -> Decoder:
    """A CPU decoder whose supported matrices stay packed in the mapped file."""
    packed = _packed_weights(config, reader, library)
    with torch.device("meta"):
        decoder = Decoder(config).to(dtype)
    _drop_dense_storage(decoder, packed)
    decoder = decoder.to_empty(device="cpu")
    if config.tie_word_embeddings:
        decoder.tie_lm_head()
    dense = gguf_loader.iter_gguf_tensors(reader, config, skip=packed.hf_names)
    load_weights(decoder, dense, provided=packed.hf_names)
    if packed.lm_head is None and packed.embedding is not None and decoder.is_tied:
        packed.lm_head = packed.embedding  # no output.weight in the file: the head is the table
    decoder.config.tie_word_embeddings = decoder.is_tied
    decoder.embed_packed = packed.embedding
    decoder.gguf_packed = packed
    decoder.reset_rope_table()
    return decoder.eval().requires_grad_(False)


def _packable(tensor: GgufTensor | None) -> bool:
    return (tensor is not None and len(tensor.shape) == 2
            and int(tensor.tensor_type) in gguf_kernels.SUPPORTED_TYPES)


def _part(tensor: GgufTensor, row_map: np.ndarray | None) -> QuantizedPart:
    rows = None if row_map is None else torch.from_numpy(row_map.astype(np.int64))
    return QuantizedPart(int(tensor.tensor_type), tensor.data, rows, tensor.shape[0])


def _qk_row_map(kind: str, tensor: GgufTensor, config: ModelConfig, permuted: bool):
    """Row order that undoes llama.cpp's Q/K permutation (gguf_loader.unpermute_qk)."""
    if not permuted or kind not in ("attn_q", "attn_k"):
        return None
    heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
    rows = np.arange(tensor.shape[0]).reshape(-1, 1)
    return gguf_loader.unpermute_qk(rows, heads).reshape(-1)


def _packed_weights(config: ModelConfig, reader: GgufFile,
                    library: gguf_kernels.GgufLibrary) -> PackedGguf:
    permuted = gguf_loader.gguf_architecture(reader) in gguf_loader.PERMUTED_QK_ARCHITECTURES
    result = PackedGguf([], None, None, library)
    for index in range(config.num_layers):
        layer = {}
        for _, _, packed_name, kinds in _LAYER_GROUPS:
            tensors = [reader.tensor(f"blk.{index}.{kind}.weight") for kind in kinds]
            if not all(_packable(t) for t in tensors):
                continue  # the whole fused group stays dense
            parts = tuple(_part(t, _qk_row_map(kind, t, config, permuted))
                          for kind, t in zip(kinds, tensors))
            layer[packed_name] = QuantizedWeight(parts, tensors[0].shape[1], library)
            result.hf_names.update(gguf_loader.hf_tensor_name(t.name) for t in tensors)
        result.layers.append(layer)
    result.embedding = _single(reader, "token_embd.weight", library, result.hf_names)
    result.lm_head = _single(reader, "output.weight", library, result.hf_names)
    return result


def _single(reader: GgufFile, name: str, library, hf_names: set[str]) -> QuantizedWeight | None:
    tensor = reader.tensor(name)
    if not _packable(tensor):
        return None
    hf_names.add(gguf_loader.hf_tensor_name(name))
    return QuantizedWeight((_part(tensor, None),), tensor.shape[1], library)


def _drop_dense_storage(decoder: Decoder, packed: PackedGguf) -> None:
    """Packed matrices get an empty [0, in] placeholder instead of dense storage."""
    for layer, weights in zip(decoder.layers, packed.layers):
        for module_name, weight_name, packed_name, _ in _LAYER_GROUPS:
            if packed_name in weights:
                module = getattr(layer, module_name)
                setattr(module, weight_name, placeholder_like(getattr(module, weight_name)))
    if packed.embedding is not None:
        decoder.embed_weight = placeholder_like(decoder.embed_weight)
    if packed.lm_head is not None and not decoder.config.tie_word_embeddings:
        decoder.lm_head_weight = placeholder_like(decoder.lm_head_weight)
