"""A lean GGUF container reader: metadata and memory-mapped tensor data, nothing else.

gguf.GGUFReader parses every element of every metadata array into its own numpy view; for
the default model's 49k-token vocabulary and 49k merges that was about half of the load
(bench/FIGURES.md). pagedgen never needs those strings (transformers builds the tokenizer from the
file itself), so this reader skips over string arrays and keeps everything else. Values are
decoded with the `gguf` package's own type tables; dequantization stays with gguf.quants.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(slots=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # torch order (ggml lists the fastest dimension first)
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # uint8 [*shape[:-1], bytes per row], a read-only view of the file


@dataclass(slots=True)
class GgufFile:
    path: Path
    metadata: dict[str, Any]  # string arrays (vocabulary, merges) are replaced by their length
    tensors: list[GgufTensor]

    def tensor(self, name: str) -> GgufTensor | None:
        return next((t for t in self.tensors if t.name == name), None)


def read_gguf(path: Path | str) -> GgufFile:
    path = Path(path)
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    cursor = _Cursor(blob, path)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    cursor.pos = 4
    version, tensor_count, kv_count = cursor.unpack("<IQQ")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; supported: {SUPPORTED_VERSIONS}")
    metadata = {cursor.string(): cursor.value(cursor.unpack("<I")[0]) for _ in range(kv_count)}
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = [_tensor(blob, data_start, *info) for info in infos]
    return GgufFile(path=path, metadata=metadata, tensors=tensors)


def _tensor_info(cursor: "_Cursor") -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cursor.string()
    (dims,) = cursor.unpack("<I")
    shape = tuple(reversed(cursor.unpack(f"<{dims}Q")))
    tensor_type, offset = cursor.unpack("<IQ")
    return name, shape, GGMLQuantizationType(tensor_type), offset


def _tensor(blob: np.ndarray, data_start: int, name: str, shape: tuple[int, ...],
            tensor_type: GGMLQuantizationType, offset: int) -> GgufTensor:
    block_elements, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if shape[-1] % block_elements:
        raise ValueError(f"GGUF tensor {name}: row of {shape[-1]} is not whole {tensor_type.name} blocks")
    row_bytes = shape[-1] // block_elements * block_bytes
    start = data_start + offset
    data = blob[start:start + prod(shape[:-1]) * row_bytes].reshape(*shape[:-1], row_bytes)
    return GgufTensor(name=name, shape=shape, tensor_type=tensor_type, data=np.asarray(data))


class _Cursor:
    """Sequential little-endian decoding of the header."""

    def __init__(self, blob: np.ndarray, path: Path) -> None:
        self.blob, self.path, self.pos = blob, path, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        text = bytes(self.blob[self.pos:self.pos + length]).decode("utf-8")
        self.pos += length
        return text

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])[0]
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            return self.array()
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")

    def array(self) -> Any:
        element_type, count = self.unpack("<IQ")
        if element_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[element_type]
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.blob, self.pos))
            self.pos += count * struct.calcsize(fmt)
            return values
        if element_type == GGUFValueType.STRING:
            for _ in range(count):  # skipped: only its length is kept
                (length,) = self.unpack("<Q")
                self.pos += length
            return count
        return [self.value(element_type) for _ in range(count)]
