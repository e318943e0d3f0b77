"""The dense projection GEMM on CPU with weights repacked once (linear.py says which packing
and why): the packing, and the product through it. Its own module so that
quantized_linear.py, whose large-row route runs a GGUF weight dequantized for the call through
the same GEMM, does not import linear.py (which imports it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.kernels.cpu import backend as cpu_backend
from pagedgen.model.layers.row_tiles import ROWS, RowTiled

AMX_MAX_ROWS = 256  # beyond it F.linear catches up, and x no longer fits L2
AVX512_MAX_ROWS = 2048  # at least as fast as oneDNN and F.linear up to here (bench/bench_gemm.py)
# Every row count: torch's bf16 GEMM on these CPUs (no bf16 arithmetic) is several times slower.
AVX2_MAX_ROWS = 1 << 62
MAX_ROWS = {"amx": AMX_MAX_ROWS, "avx512": AVX512_MAX_ROWS, "avx2": AVX2_MAX_ROWS}
# Packings whose product never falls back to F.linear on the plain weight.
TAKE_EVERY_ROW_COUNT = ("onednn", "avx2")
_KERNELS = {"amx": cpu_backend.amx_linear, "avx512": cpu_backend.avx512_linear,
            "avx2": cpu_backend.avx2_linear}


@dataclass(frozen=True, slots=True)
class PackedWeight:
    kind: str  # "amx", "avx512", "avx2" (all three: our packing) or "onednn"
    data: torch.Tensor
    out_features: int


def pack_weight(weight: torch.Tensor, rows_hint: int = 64, row_tiled: bool = False
                ) -> PackedWeight | RowTiled | None:
    """A repacked copy of a [out, in] weight, or None where packing does not apply;
    row_tiled: wrapped so that every projection runs on fixed-size row tiles."""
    if row_tiled:
        return RowTiled(pack_weight(weight, ROWS))
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    # Our kernels multiply bf16; float32 weights go to oneDNN, whose packing spares MKL's copy
    # of the whole weight on every call (F.linear's), which costs as much as a decode step's
    # products at 1-64 rows.
    kind = cpu_backend.gemm_kind() if weight.dtype == torch.bfloat16 else None
    ours = None if kind is None else cpu_backend.gemm_pack(weight.detach())
    if ours is not None:
        return PackedWeight(kind, ours, weight.shape[0])
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
    except (RuntimeError, AttributeError):  # a torch build without these ops
        return None
    return PackedWeight("onednn", onednn, weight.shape[0])


def pack_releasing(module: nn.Module, weight_name: str, current: object | None,
                   row_tiled: bool = False) -> PackedWeight | RowTiled | None:
    """pack_weight(module.<weight_name>), and where the product reads nothing but the packing
    (oneDNN's takes every row count) the plain weight gives way to an empty placeholder, so
    that the weights are not held twice. A weight released by an earlier packing keeps that
    packing (`current`), re-wrapped for `row_tiled`. Not for a weight that has other readers
    (a tied embedding)."""
    weight = getattr(module, weight_name)
    if weight.device.type == "meta":
        return RowTiled(_untiled(current)) if row_tiled else _untiled(current)
    packed = pack_weight(weight, row_tiled=row_tiled)
    inner = _untiled(packed)
    if isinstance(inner, PackedWeight) and inner.kind in TAKE_EVERY_ROW_COUNT:
        setattr(module, weight_name, placeholder_like(weight))
    return packed


def _untiled(packed: object | None) -> object | None:
    return packed.inner if isinstance(packed, RowTiled) else packed


def placeholder_like(weight: torch.Tensor) -> nn.Parameter:
    """An empty [0, in] stand-in, no storage, for a matrix whose rows live elsewhere."""
    return nn.Parameter(torch.empty(0, weight.shape[1], device="meta", dtype=weight.dtype),
                        requires_grad=False)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed: PackedWeight | None = None) -> torch.Tensor:
    """x @ weight.T + bias through the packed weight (our kernels within their row range, else
    F.linear; oneDNN's packing through oneDNN), or F.linear without one."""
    if packed is None:
        return F.linear(x, weight, bias)
    kernel = _KERNELS.get(packed.kind)
    if kernel is not None:
        if x.shape[0] <= MAX_ROWS[packed.kind]:
            out = kernel(x, packed.data, packed.out_features, bias)
            if out is None and weight.is_meta:  # a layout the kernel reads, or nothing else can
                out = kernel(x.to(torch.bfloat16).contiguous(), packed.data, packed.out_features, bias)
            if out is not None:
                return out
        if weight.is_meta:
            raise MemoryError(f"the {packed.kind} GEMM declined a [{x.shape[0]}, {x.shape[1]}] "
                              "input (out of memory for its widened rows?) and the weight is "
                              "held only in its packing")
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.data, bias, "none", [], "")
