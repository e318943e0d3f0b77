"""What a loaded model's weights hold in memory, by kind, for the memory report.

Three kinds of bytes sit behind a model's projections:
- plain: the parameters and buffers (unique storages), in the run's dtype;
- repacked: the copies our GEMM kernels or oneDNN read; the AMX and AVX-512 kernels' sit
  beside the plain weights, which serve the row counts those kernels do not take, oneDNN's
  and the AVX2 kernel's stand in for them (model/layers/linear.py);
- GGUF blocks: with weights="packed", the file's quantized blocks, views of the mapped file
  (resident as the kernels touch them; nothing is copied).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class WeightBytes:
    plain_bytes: int
    repacked_bytes: int
    gguf_block_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.plain_bytes + self.repacked_bytes + self.gguf_block_bytes

    def as_dict(self) -> dict[str, int]:
        return {"plain_bytes": self.plain_bytes, "repacked_bytes": self.repacked_bytes,
                "gguf_block_bytes": self.gguf_block_bytes, "total_bytes": self.total_bytes}


def weight_bytes(model: torch.nn.Module) -> WeightBytes:
    storages: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        _add_storage(storages, tensor)
    plain = sum(storages.values())
    repacked: dict[int, int] = {}
    for packed in _packed_weights(model):
        data = getattr(getattr(packed, "inner", packed), "data", None)
        if isinstance(data, torch.Tensor) and _storage_key(data) not in storages:
            _add_storage(repacked, data)
    return WeightBytes(plain, sum(repacked.values()), gguf_block_bytes(model))


def gguf_block_bytes(model: Any) -> int:
    """The GGUF blocks the packed kernels read from the mapped file (0 without packed weights)."""
    packed = getattr(model, "gguf_packed", None)
    return packed.stored_bytes if packed is not None else 0


def _add_storage(seen: dict[int, int], tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta":
        return
    if tensor.is_mkldnn:  # oneDNN's packing: an opaque tensor, its own bytes, no storage
        seen[_storage_key(tensor)] = tensor.numel() * tensor.element_size()
    else:
        seen[_storage_key(tensor)] = tensor.untyped_storage().nbytes()


def _storage_key(tensor: torch.Tensor) -> int:
    return id(tensor) if tensor.is_mkldnn else tensor.untyped_storage().data_ptr()


def _packed_weights(model: Any) -> list[Any]:
    """Every projection's packing (None where a projection has none)."""
    found = [getattr(model, "lm_head_packed", None)]
    for layer in getattr(model, "layers", ()):
        found += [layer.attention.qkv_packed, layer.attention.o_packed,
                  layer.mlp.gate_up_packed, layer.mlp.down_packed]
    return [p for p in found if p is not None]
