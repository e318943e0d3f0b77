"""Inputs, the reference and shared checks for the native GEMM tests (AMX, AVX-512 BF16, AVX2)."""
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


def assert_one_rounding_apart(got, expected):
    """Same products, another summation order: at most one bf16 rounding step apart."""
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-3)


def results_at_thread_counts(linear, *args, counts=(1, 3, 8)):
    """linear(*args) run under each torch thread count, the caller's count restored after."""
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in counts:
            torch.set_num_threads(threads)
            results.append(linear(*args))
    finally:
        torch.set_num_threads(saved)
    return results
