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

import torch

from pagedgen.model.layers.dense_linear import (  # noqa: F401  (re-exported)
    _KERNELS, AMX_MAX_ROWS, AVX512_MAX_ROWS, MAX_ROWS, PackedWeight, dense_linear, pack_weight)
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
