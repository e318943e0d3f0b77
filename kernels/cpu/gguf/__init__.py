"""GEMM and row look-ups on GGUF-packed weights, in place in the file's bytes (C kernels in
gguf_gemm.c, one library per kernel path: build.py). Functions take a `library` (from
build.best() or build.load_path(name)) so tests and benchmarks can run any path."""
from __future__ import annotations

import numpy as np
import torch

from .build import GgufKernelUnavailable, GgufLibrary, best, load_path

__all__ = ["BLOCK_SHAPES", "GgufKernelUnavailable", "GgufLibrary", "SUPPORTED_TYPES", "best",
           "dequantize_rows", "gemm", "has_bf16_tiles", "load_path"]

# ggml type number -> (values per block, bytes per block), for the types the kernels read.
BLOCK_SHAPES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                12: (256, 144), 13: (256, 176), 14: (256, 210)}
SUPPORTED_TYPES = frozenset(BLOCK_SHAPES)


def _pointer(blocks: np.ndarray | torch.Tensor) -> int:
    if isinstance(blocks, torch.Tensor):
        return blocks.data_ptr()
    return blocks.ctypes.data


def _check_blocks(tensor_type: int, blocks, k: int) -> tuple[int, int]:
    """(rows, row_bytes) of a C-contiguous uint8 [rows, row_bytes] block array."""
    if tensor_type not in BLOCK_SHAPES:
        raise ValueError(f"ggml type {tensor_type} has no packed kernel")
    values, size = BLOCK_SHAPES[tensor_type]
    rows, row_bytes = blocks.shape
    contiguous = (blocks.is_contiguous() if isinstance(blocks, torch.Tensor)
                  else blocks.flags.c_contiguous)
    if k % values or row_bytes != k // values * size or not contiguous:
        raise ValueError(f"blocks of shape {tuple(blocks.shape)} are not contiguous rows of "
                         f"{k} values of ggml type {tensor_type}")
    return rows, row_bytes


def gemm(library: GgufLibrary, tensor_type: int, blocks, k: int, x: torch.Tensor,
         row_map: torch.Tensor | None = None, out: torch.Tensor | None = None,
         threads: int | None = None, bf16_from_rows: int = 0,
         round_to_bf16: bool = False) -> torch.Tensor:
    """float32 [M, N] = x @ W^T, W the packed rows (row_map[n] picks W's row for column n).

    x: float32 or bf16 [M, k], rows contiguous; out: a float32 [M, N] view whose rows may be
    strided (a column slice of a wider output). bf16 x of at least bf16_from_rows rows (0:
    never) runs the bf16 tile GEMM where the library has one (has_bf16_tiles): the product of
    the dequantized bf16 weight, instead of the int8 kernel's. round_to_bf16: every output
    rounded to bf16 and kept in float32 (the bf16 result widened, in the kernel's pass)."""
    rows, row_bytes = _check_blocks(tensor_type, blocks, k)
    n = rows if row_map is None else row_map.shape[0]
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.shape[1] != k \
            or x.stride(1) != 1:
        raise ValueError(f"x must be float32/bf16 [M, {k}] with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)}")
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
    if out.dtype != torch.float32 or tuple(out.shape) != (x.shape[0], n) or out.stride(1) != 1:
        raise ValueError("out must be float32 [M, N] with contiguous rows")
    status = library.library.gguf_gemm(
        tensor_type, _pointer(blocks), row_bytes, None if row_map is None else row_map.data_ptr(),
        n, k, x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), x.shape[0],
        out.data_ptr(), out.stride(0), threads or torch.get_num_threads(), bf16_from_rows,
        int(round_to_bf16))
    _raise_for(status, "gguf_gemm")
    return out


def has_bf16_tiles(library: GgufLibrary) -> bool:
    return library.bf16_tiles


def tiles_form(library: GgufLibrary, form: int = -2) -> int:
    """The bf16 tiles' form: 1 float32 FMAs on the widened tile (where VDPBF16PS multiplies
    slower), 0 VDPBF16PS; -2 reads it, 0 or 1 sets it (the tests run each on any CPU)."""
    return library.library.gguf_bf16_tiles_form(form) if library.bf16_tiles else 0


def dequantize_rows(library: GgufLibrary, tensor_type: int, blocks, k: int,
                    row_map: torch.Tensor | None = None, value_dtype: torch.dtype = torch.float32,
                    threads: int | None = None) -> torch.Tensor:
    """[len(row_map) or rows, k] values of the picked rows in float32 or bf16."""
    rows, row_bytes = _check_blocks(tensor_type, blocks, k)
    n = rows if row_map is None else row_map.shape[0]
    if row_map is not None and row_map.dtype != torch.int64:
        raise ValueError("row_map must be int64")
    out = torch.empty(n, k, dtype=value_dtype)
    status = library.library.gguf_dequantize_rows(
        tensor_type, _pointer(blocks), row_bytes, None if row_map is None else row_map.data_ptr(),
        n, k, out.data_ptr(), int(value_dtype == torch.bfloat16), k,
        threads or torch.get_num_threads())
    _raise_for(status, "gguf_dequantize_rows")
    return out


def _raise_for(status: int, name: str) -> None:
    if status == 1:
        raise ValueError(f"{name}: unsupported type or shape")
    if status == 2:
        raise MemoryError(f"{name}: out of memory")
