"""Projections and embedding look-ups on GGUF weights kept in their packed blocks.

A QuantizedWeight is one logical [out, in] weight made of parts, each a run of rows of one
GGUF tensor (memory-mapped from the file, never copied): q/k/v stacked into one projection,
gate/up likewise, a plain tensor as a single part. A part may read its tensor's rows in
another order (row_map): that is how llama.cpp's permuted Q/K rows are put back in
transformers' order without copying the tensor.

Three kernels, chosen by the number of rows (bench/bench_gguf_gemm.py measures the crossovers):
 - few rows: the int8 kernels (kernels/cpu/gguf: activations quantized in two int8 codes per
   value with a step per 32 values, or per 256 for the K-quants, integer dot products, weight
   blocks decoded in registers);
 - bf16 activations from tiles_min_rows() rows on, where the library has AVX-512 BF16: the
   bf16 tile GEMM (a few weight rows decoded to bf16 in cache, then run against every row),
   which computes what the dequantized bf16 path computes (from a few dozen rows on, with the
   dense GEMM's own micro-tiles; in the amx_bf16 library, with the dense AMX GEMM's own tile
   products);
 - from dequantize_min_rows() on: the weight dequantized for the call (to bf16 where the CPU
   multiplies bf16 in hardware and the run is bf16, else to float32) and the dense GEMM, whose
   blocking wins on many rows.
Batch-invariant mode keeps the int8 kernels at every row count, so that a row's result does not
depend on how many rows share its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedgen.kernels.cpu import gguf as gguf_kernels
from pagedgen.model.cpuinfo import cpuinfo_value
from pagedgen.model.dtypes import cpu_has_bf16_arithmetic
from pagedgen.model.layers.dense_linear import AVX512_MAX_ROWS, dense_linear, pack_weight


# bf16 rows: int8 kernels below, bf16 tiles from here (AVX-512 BF16). The crossover is measured
# per CPU kind (bench/GGUF_FIGURES.md): 4 rows on AMD Zen 4; on Intel Xeon (Sapphire / Emerald
# Rapids, the tiles' float32 form) 8. Projections of K-quants only cross later, since their
# int8 kernel sums whole super-blocks in integers: 10 rows on AMD Zen 4, 16 on those Xeons.
_INTEL = cpuinfo_value("vendor_id") == "GenuineIntel"
BF16_TILES_MIN_ROWS = 8 if _INTEL else 4
BF16_TILES_MIN_ROWS_K_QUANTS = 16 if _INTEL else 10
# The amx_bf16 library's tiles multiply on the tile unit, so only the decode is left to pay:
# they overtake the int8 kernels from 6 rows, K-quants included (Intel Xeon with AMX).
AMX_TILES_MIN_ROWS = 6
K_QUANTS = frozenset({12, 13, 14})  # ggml's Q4_K, Q5_K, Q6_K
DEQUANTIZE_MIN_ROWS = 64  # without bf16 tiles: int8 kernels below, dequantize + GEMM from here
# From a few dozen rows the tiles run the dense GEMM's own micro-tiles on weight panels
# decoded per tile: dequantize + GEMM, which writes the whole weight to fresh memory first,
# measured no faster up to the dense GEMM's row limit (in either form).
DEQUANTIZE_MIN_ROWS_AFTER_PANELS = AVX512_MAX_ROWS + 1
# The AMX tiles decode the weight once per chunk of rows; from about here decoding it once
# for the call and running the dense AMX GEMM is as fast or faster, for short rows and long
# ones alike (a down projection's 8,192 inputs are taken in runs of K; bench/GGUF_FIGURES.md).
DEQUANTIZE_MIN_ROWS_AFTER_AMX_TILES = 2048


def tiles_min_rows(library: gguf_kernels.GgufLibrary, tensor_types) -> int:
    """Rows from which a projection of these parts' types runs the bf16 tiles: one figure for
    the whole projection, so that the fused decode step makes the same choice as the layers."""
    if library.path == "amx_bf16":
        return AMX_TILES_MIN_ROWS
    k_quants = all(tensor_type in K_QUANTS for tensor_type in tensor_types)
    return BF16_TILES_MIN_ROWS_K_QUANTS if k_quants else BF16_TILES_MIN_ROWS


def dequantize_min_rows(library: gguf_kernels.GgufLibrary) -> int:
    """Rows from which dequantize + dense GEMM beats the packed kernels of this library."""
    if library.path == "amx_bf16":
        return DEQUANTIZE_MIN_ROWS_AFTER_AMX_TILES
    if gguf_kernels.has_bf16_tiles(library):
        return DEQUANTIZE_MIN_ROWS_AFTER_PANELS
    return DEQUANTIZE_MIN_ROWS


@dataclass(frozen=True, slots=True)
class QuantizedPart:
    tensor_type: int  # ggml type number
    blocks: np.ndarray  # uint8 [rows, row_bytes], a view of the memory-mapped file
    row_map: torch.Tensor | None  # int64 [out]: tensor row of each output column; None: in order
    out_features: int


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    parts: tuple[QuantizedPart, ...]
    in_features: int
    library: gguf_kernels.GgufLibrary
    invariant: bool = False  # batch-invariant mode: always the int8 kernels
    kind: str = "gguf"  # what linear.pack_weight's PackedWeight calls its kernel family

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def stored_bytes(self) -> int:
        return sum(part.blocks.nbytes for part in self.parts)

    def with_invariance(self, invariant: bool) -> "QuantizedWeight":
        if invariant == self.invariant:
            return self
        return QuantizedWeight(self.parts, self.in_features, self.library, invariant)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None,
                     round_to_bf16: bool = False) -> torch.Tensor:
    """x @ W^T (+ bias) in out_dtype (default x's dtype). round_to_bf16: the result rounded to
    bf16 first (float32 out is then the bf16 result widened, as the dense path gives the LM
    head its logits), in the kernel's own pass where there is no bias."""
    out_dtype = out_dtype or x.dtype
    rows = x.reshape(-1, weight.in_features)
    if rows.dtype not in (torch.float32, torch.bfloat16):
        rows = rows.float()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    rounded_in_kernel = round_to_bf16 and bias is None
    if rows.shape[0] >= dequantize_min_rows(weight.library) \
            and not weight.invariant:
        out = dequantized_linear(rows, weight)
    else:
        out = torch.empty(rows.shape[0], weight.out_features, dtype=torch.float32)
        tiles_from = 0 if weight.invariant else tiles_min_rows(
            weight.library, (part.tensor_type for part in weight.parts))
        column = 0
        for part in weight.parts:
            gguf_kernels.gemm(weight.library, part.tensor_type, part.blocks, weight.in_features,
                              rows, part.row_map, out[:, column:column + part.out_features],
                              bf16_from_rows=tiles_from, round_to_bf16=rounded_in_kernel)
            column += part.out_features
    if bias is not None:
        out = out + bias
    if round_to_bf16 and not rounded_in_kernel:
        out = out.to(torch.bfloat16)
    return out.to(out_dtype).reshape(*x.shape[:-1], weight.out_features)


def dequantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x @ W^T with W dequantized for this call (in dense_dtype) and run as the dense model's
    layers run theirs: bf16 packed for our GEMM where the CPU has one, else F.linear."""
    dtype = dense_dtype(x.dtype)
    dense = dequantized(weight, dtype)
    # A float32 weight made for one call is not worth oneDNN's reorder: F.linear's own copy of
    # it is part of the crossover measured for this route.
    packed = pack_weight(dense) if dtype == torch.bfloat16 else None
    return dense_linear(x.to(dtype), dense, None, packed)


def dense_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the large-row route's GEMM for activations of x_dtype: bf16 only where the
    CPU multiplies bf16 in hardware; float32 runs, and CPUs whose bf16 GEMM would be emulated
    (several times slower than their float32 one), multiply in float32."""
    bf16 = x_dtype == torch.bfloat16 and cpu_has_bf16_arithmetic()
    return torch.bfloat16 if bf16 else torch.float32


def dequantized(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight [out, in] in dtype (a temporary: large-row GEMMs and tests)."""
    return torch.cat([gguf_kernels.dequantize_rows(weight.library, part.tensor_type, part.blocks,
                                                   weight.in_features, part.row_map, dtype)
                      for part in weight.parts])


def embedding_rows(token_ids: torch.Tensor, weight: QuantizedWeight,
                   dtype: torch.dtype) -> torch.Tensor:
    """F.embedding on the packed table: only the looked-up rows are dequantized."""
    (part,) = weight.parts
    ids = token_ids.reshape(-1).to(torch.int64)
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < part.out_features:
        raise IndexError(f"token id out of range for an embedding of {part.out_features} rows")
    if part.row_map is not None:
        ids = part.row_map[ids]
    rows = gguf_kernels.dequantize_rows(weight.library, part.tensor_type, part.blocks,
                                        weight.in_features, ids.contiguous(),
                                        torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    return rows.to(dtype).reshape(*token_ids.shape, weight.in_features)
