"""Inputs and the reference for the native GEMM tests (AMX and AVX-512 BF16 kernels)."""
from __future__ import annotations

import torch


def reference_linear(x, weight, bias=None):
    """float32 sums of the same bf16 inputs, rounded once to bf16: what the kernels promise."""
    out = x.float() @ weight.float().T
    return (out if bias is None else out + bias.float()).to(torch.bfloat16)


def gemm_case(rows, out_features, in_features, seed=0):
    """bf16 x [rows, in], weight [out, in] (scaled to unit-size outputs) and bias [out]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    return x, weight.to(torch.bfloat16), bias
