"""The weights' sizes read from a model's files, without loading them (for inspect-memory).

A GGUF file's tensor table and a safetensors file's JSON header both give each tensor's shape
and byte range, so the bytes as stored and the parameter count cost a header read.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedgen.model.loading.source import ModelSource


@dataclass(frozen=True, slots=True)
class WeightFileSizes:
    stored_bytes: int        # the tensors' bytes in the files (quantized blocks for GGUF)
    parameters: int          # elements of every tensor
    matrix_parameters: int   # elements of the 2-D tensors (what the GEMM kernels repack)


def weight_file_sizes(source: ModelSource) -> WeightFileSizes:
    if source.kind == "gguf":
        from pagedgen.model.loading.gguf_file import read_gguf

        tensors = [(t.shape, t.data.nbytes) for t in read_gguf(source.path).tensors]
    else:
        tensors = [entry for path in sorted(source.path.glob("*.safetensors"))
                   for entry in _safetensors_entries(path)]
    return WeightFileSizes(sum(size for _, size in tensors),
                           sum(math.prod(shape) for shape, _ in tensors),
                           sum(math.prod(shape) for shape, _ in tensors if len(shape) == 2))


def _safetensors_entries(path: Path) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of every tensor, from the header: an 8-byte length, then JSON."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return [(tuple(entry["shape"]), entry["data_offsets"][1] - entry["data_offsets"][0])
            for name, entry in header.items() if name != "__metadata__"]
