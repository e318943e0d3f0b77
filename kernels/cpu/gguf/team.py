"""A packed projection as the fused decode step reads it: ctypes mirrors of gguf_gemm.c's
GgufPart and GgufProjection (same fields, same order: tests/test_native_bindings.py checks
them against the C), and gguf_linear_team's address and scratch size.

kernels/cpu/decode_step.c lives in another library than the GGUF kernels (which are built once
per kernel path), so it calls gguf_linear_team through the address given here, inside its own
parallel region."""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from .build import GgufLibrary

MAX_PARTS = 3  # GGUF_MAX_PARTS: q, k and v


class GgufPart(ctypes.Structure):
    _fields_ = [("blocks", ctypes.c_void_p), ("row_map", ctypes.c_void_p),
                ("row_bytes", ctypes.c_int64), ("rows", ctypes.c_int64), ("type", ctypes.c_int)]


class GgufProjection(ctypes.Structure):
    _fields_ = [("parts", GgufPart * MAX_PARTS), ("num_parts", ctypes.c_int),
                ("k", ctypes.c_int64), ("bf16_from_rows", ctypes.c_int64)]


def projection(parts: Sequence[tuple[int, np.ndarray, torch.Tensor | None, int]], k: int,
               bf16_from_rows: int) -> GgufProjection | None:
    """The C description of (ggml type, uint8 blocks [rows, row_bytes], int64 row_map or None,
    output columns) parts side by side; None where there are more parts than it holds. The
    arrays must outlive it (it holds their addresses)."""
    if not 1 <= len(parts) <= MAX_PARTS:
        return None
    described = GgufProjection()
    for index, (tensor_type, blocks, row_map, columns) in enumerate(parts):
        if row_map is not None and (row_map.dtype != torch.int64 or not row_map.is_contiguous()):
            return None
        if blocks.dtype != np.uint8 or blocks.ndim != 2 or not blocks.flags.c_contiguous:
            return None
        described.parts[index] = GgufPart(blocks.ctypes.data,
                                           None if row_map is None else row_map.data_ptr(),
                                           blocks.shape[1], columns, tensor_type)
    described.num_parts, described.k, described.bf16_from_rows = len(parts), k, bf16_from_rows
    return described


def linear_team_address(library: GgufLibrary) -> int:
    """gguf_linear_team's address in `library`, for decode_step.c's DecodeModelShape."""
    return ctypes.cast(library.library.gguf_linear_team, ctypes.c_void_p).value


def scratch_bytes(library: GgufLibrary, rows: int, k: int) -> int:
    """Bytes of the quantized-activation scratch gguf_linear_team needs for rows x k."""
    return int(library.library.gguf_linear_scratch_bytes(rows, k))


def linear(library: GgufLibrary, described: GgufProjection, x: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = x @ W^T + bias through gguf_linear_team on the calling thread (tests; the
    decode step calls it from its parallel region)."""
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or k != described.k or x.stride(1) != 1:
        raise ValueError(f"x must be bf16 [M, {described.k}] with contiguous rows")
    n = sum(described.parts[i].rows for i in range(described.num_parts))
    if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (n,)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous bf16 [{n}]")
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    y = torch.empty(rows, n, dtype=torch.float32)
    acts = torch.empty(scratch_bytes(library, rows, k), dtype=torch.uint8)
    failed = ctypes.c_int(0)
    library.library.gguf_linear_team(
        ctypes.byref(described), x.data_ptr(), x.stride(0),
        None if bias is None else bias.data_ptr(), out.data_ptr(), rows, y.data_ptr(),
        acts.data_ptr(), ctypes.byref(failed))
    if failed.value:
        raise MemoryError("gguf_linear_team: a thread could not allocate its scratch")
    return out
