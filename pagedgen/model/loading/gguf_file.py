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
MAX_DIMS = 4            # GGML_MAX_DIMS: ggml tensors have 1 to 4 dimensions
MAX_ARRAY_NESTING = 4   # real files nest at most 1 deep; a hand-made header could recurse forever
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
    # Each entry takes at least 12 bytes: a count beyond that is a corrupt header, not a loop.
    cursor.check_count(kv_count, 12, "metadata entries")
    metadata = {cursor.string(): cursor.value(cursor.unpack("<I")[0]) for _ in range(kv_count)}
    cursor.check_count(tensor_count, 24, "tensors")
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment must be a positive power of two, got {alignment!r}")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = [_tensor(blob, data_start, *info) for info in infos]
    return GgufFile(path=path, metadata=metadata, tensors=tensors)


def _tensor_info(cursor: "_Cursor") -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cursor.string()
    (dims,) = cursor.unpack("<I")
    if not 1 <= dims <= MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
    shape = tuple(reversed(cursor.unpack(f"<{dims}Q")))
    tensor_type, offset = cursor.unpack("<IQ")
    if tensor_type not in GGMLQuantizationType._value2member_map_ or \
            GGMLQuantizationType(tensor_type) not in GGML_QUANT_SIZES:
        raise ValueError(f"tensor {name!r} has unknown ggml type {tensor_type}")
    return name, shape, GGMLQuantizationType(tensor_type), offset


def _tensor(blob: np.ndarray, data_start: int, name: str, shape: tuple[int, ...],
            tensor_type: GGMLQuantizationType, offset: int) -> GgufTensor:
    block_elements, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if min(shape) == 0:
        raise ValueError(f"tensor {name!r} has an empty dimension: shape {shape}")
    if shape[-1] % block_elements:
        raise ValueError(f"GGUF tensor {name}: row of {shape[-1]} is not whole {tensor_type.name} blocks")
    row_bytes = shape[-1] // block_elements * block_bytes
    start = data_start + offset
    end = start + prod(shape[:-1]) * row_bytes
    if end > len(blob):
        raise ValueError(f"tensor {name!r} (shape {shape}, {tensor_type.name}) ends at byte {end:,}, "
                         f"past the end of the file ({len(blob):,} bytes): truncated or corrupt")
    data = blob[start:end].reshape(*shape[:-1], row_bytes)
    return GgufTensor(name=name, shape=shape, tensor_type=tensor_type, data=np.asarray(data))


class _Cursor:
    """Sequential little-endian decoding of the header."""

    def __init__(self, blob: np.ndarray, path: Path) -> None:
        self.blob, self.path, self.pos = blob, path, 0
        self.depth = 0   # nesting of the array being read

    def check_count(self, count: int, min_bytes_each: int, what: str) -> None:
        """A count that the rest of the file cannot hold is refused before anything is built."""
        if count * min_bytes_each > len(self.blob) - self.pos:
            raise ValueError(f"the header declares {count:,} {what}, more than the "
                             f"{len(self.blob):,}-byte file can hold: truncated or corrupt")

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        self.check_count(length, 1, "string bytes")
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
        if self.depth >= MAX_ARRAY_NESTING:
            raise ValueError(f"metadata arrays nested more than {MAX_ARRAY_NESTING} deep")
        if element_type in _SCALAR_FORMATS:
            self.check_count(count, struct.calcsize(_SCALAR_FORMATS[element_type]), "array elements")
            fmt = _SCALAR_FORMATS[element_type]
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.blob, self.pos))
            self.pos += count * struct.calcsize(fmt)
            return values
        self.check_count(count, 8 if element_type == GGUFValueType.STRING else 1, "array elements")
        if element_type == GGUFValueType.STRING:
            for _ in range(count):  # skipped: only its length is kept
                (length,) = self.unpack("<Q")
                self.check_count(length, 1, "string bytes")
                self.pos += length
            return count
        self.depth += 1
        try:
            return [self.value(element_type) for _ in range(count)]
        finally:
            self.depth -= 1
