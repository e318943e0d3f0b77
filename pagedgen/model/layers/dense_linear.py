"""The dense projection GEMM on CPU in bfloat16 with weights repacked once (linear.py says
which packing and why): the packing, and the product through it. Its own module so that
quantized_linear.py, whose large-row route runs a GGUF weight dequantized for the call through
the same GEMM, does not import linear.py (which imports it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedgen.kernels.cpu import backend as cpu_backend
from pagedgen.model.layers.row_tiles import ROWS, RowTiled

AMX_MAX_ROWS = 256  # beyond it F.linear catches up, and x no longer fits L2
AVX512_MAX_ROWS = 2048  # at least as fast as oneDNN and F.linear up to here (bench/bench_gemm.py)
MAX_ROWS = {"amx": AMX_MAX_ROWS, "avx512": AVX512_MAX_ROWS}  # rows our kernels take, per kind
_KERNELS = {"amx": cpu_backend.amx_linear, "avx512": cpu_backend.avx512_linear}


@dataclass(frozen=True, slots=True)
class PackedWeight:
    kind: str  # "amx", "avx512" (both: our packing) or "onednn"
    data: torch.Tensor
    out_features: int


def pack_weight(weight: torch.Tensor, rows_hint: int = 64, row_tiled: bool = False
                ) -> PackedWeight | RowTiled | None:
    """A repacked copy of a [out, in] weight, or None where packing does not apply;
    row_tiled: wrapped so that every projection runs on fixed-size row tiles."""
    if row_tiled:
        return RowTiled(pack_weight(weight, ROWS))
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    kind = cpu_backend.gemm_kind()
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
            if out is not None:
                return out
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.data, bias, "none", [], "")
