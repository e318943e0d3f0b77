"""Dense projections on CPU in bfloat16, with weights repacked once at start-up.

Two packings, whichever the CPU has:
- Our kernels' (kernels/cpu/gemm_common.h), one layout for two kernels: AMX
  (kernels/cpu/gemm_amx.c) where the CPU has it, else AVX-512 BF16 (kernels/cpu/gemm_avx512.c);
  used for up to MAX_ROWS[kind] rows (decode steps, small prefills), where the GEMM is bound
  by streaming the weights or by per-call costs and our kernels beat oneDNN through torch
  (bench/FIGURES.md). Larger row counts go to F.linear on the plain weight.
- oneDNN (`mkldnn._reorder_linear_weight`) where there is no AMX: F.linear reorders the weight
  on every call, slower for decode-sized GEMMs than packing once.
Either way only one packed copy is kept next to the plain weight. float32 and other devices
keep F.linear.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedgen.kernels.cpu import backend as cpu_backend
from pagedgen.model.layers.quantized_linear import QuantizedWeight, quantized_linear
from pagedgen.model.layers.row_tiles import ROWS, RowTiled, in_row_tiles

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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | RowTiled | None = None) -> torch.Tensor:
    """x @ weight.T + bias, through the packed weight when there is one."""
    if isinstance(packed, QuantizedWeight):  # GGUF blocks as stored (quantized_linear.py)
        return quantized_linear(x, packed, bias)
    if isinstance(packed, RowTiled):  # batch-invariant mode
        return in_row_tiles(lambda rows: linear(rows, weight, bias, packed.inner), x, packed.rows)
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


def linear_float32(x: torch.Tensor, weight: torch.Tensor,
                   packed: PackedWeight | RowTiled | None = None) -> torch.Tensor:
    """linear(x, weight, packed=packed).float(), in one pass where our kernels apply (the LM
    head: the sampler wants float32 logits, and a separate cast is one more pass)."""
    if isinstance(packed, QuantizedWeight):  # rounded to x's dtype first, as the dense path
        return quantized_linear(x, packed).float()
    if isinstance(packed, RowTiled):  # batch-invariant mode
        return in_row_tiles(lambda rows: linear_float32(rows, weight, packed.inner), x, packed.rows)
    kernel = None if packed is None else _KERNELS.get(packed.kind)
    if kernel is not None and x.shape[0] <= MAX_ROWS[packed.kind]:
        out = kernel(x, packed.data, packed.out_features, out_dtype=torch.float32)
        if out is not None:
            return out
    return linear(x, weight, packed=packed).float()
