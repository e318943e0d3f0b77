"""Dense projections on CPU, with weights repacked once at start-up.

bfloat16 weights get one of two packings, whichever the CPU has:
- Our kernels' (kernels/cpu/gemm_common.h), one layout for three kernels: AMX
  (kernels/cpu/gemm_amx.c) where the CPU has it, else AVX-512 BF16 (kernels/cpu/gemm_avx512.c),
  else AVX2 (kernels/cpu/gemm_avx2.c: widened in registers, float32 FMAs); used for up to
  MAX_ROWS[kind] rows (decode steps, small prefills), where the GEMM is bound by streaming the
  weights or by per-call costs and our kernels beat oneDNN through torch (bench/FIGURES.md).
  Larger row counts go to F.linear on the plain weight; the AVX2 kernel takes every row count
  (torch's bf16 GEMM there is the slow one it replaces).
- oneDNN (`mkldnn._reorder_linear_weight`) where there is none: F.linear reorders the
  weight on every call, slower for decode-sized GEMMs than packing once.
float32 weights get oneDNN's packing: without it F.linear (MKL) copies the whole weight into
its own layout on every call, as costly as a decode step's products at 1-64 rows.

oneDNN's packing and the AVX2 kernel's take every row count, so there the plain weight gives way
to a placeholder (not a tied embedding table: the look-ups read it) and the weights are held
once; the AMX and AVX-512 kernels' packing is kept next to the plain weight, which F.linear
reads above MAX_ROWS[kind]. Other devices keep F.linear.
"""
from __future__ import annotations

import torch

from pagedgen.model.layers.dense_linear import (  # noqa: F401  (re-exported)
    _KERNELS, AMX_MAX_ROWS, AVX512_MAX_ROWS, MAX_ROWS, PackedWeight, dense_linear, pack_releasing,
    pack_weight, placeholder_like)
from pagedgen.model.layers.quantized_linear import QuantizedWeight, quantized_linear
from pagedgen.model.layers.row_tiles import RowTiled, in_row_tiles


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | RowTiled | None = None) -> torch.Tensor:
    """x @ weight.T + bias, through the packed weight when there is one."""
    if isinstance(packed, QuantizedWeight):  # GGUF blocks as stored (quantized_linear.py)
        return quantized_linear(x, packed, bias)
    if isinstance(packed, RowTiled):  # batch-invariant mode
        return in_row_tiles(lambda rows: linear(rows, weight, bias, packed.inner), x, packed.rows)
    return dense_linear(x, weight, bias, packed)


def linear_float32(x: torch.Tensor, weight: torch.Tensor,
                   packed: PackedWeight | RowTiled | None = None) -> torch.Tensor:
    """linear(x, weight, packed=packed).float(), in one pass where our kernels apply (the LM
    head: the sampler wants float32 logits, and a separate cast is one more pass)."""
    if isinstance(packed, QuantizedWeight):  # the bf16 result widened, as the dense path
        return quantized_linear(x, packed, out_dtype=torch.float32,
                                round_to_bf16=x.dtype == torch.bfloat16)
    if isinstance(packed, RowTiled):  # batch-invariant mode
        return in_row_tiles(lambda rows: linear_float32(rows, weight, packed.inner), x, packed.rows)
    kernel = None if packed is None else _KERNELS.get(packed.kind)
    if kernel is not None and x.shape[0] <= MAX_ROWS[packed.kind]:
        out = kernel(x, packed.data, packed.out_features, out_dtype=torch.float32)
        if out is not None:
            return out
    return linear(x, weight, packed=packed).float()
