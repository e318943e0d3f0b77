"""Inputs, the reference and shared checks for the native GEMM tests (AMX, AVX-512 BF16, AVX2)."""
from __future__ import annotations

import torch

from pagedgen.kernels.cpu import native


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


def check_float32_output_is_the_bf16_result_widened(linear, rows):
    """The LM head's shape (49,152 x 576): the sampler wants float32 logits in one pass. At 48
    rows the logits (9 MB) pass GEMM_STREAM_MIN_BYTES: written with non-temporal stores."""
    x, weight, _ = gemm_case(rows, 49152, 576, seed=1)
    packed = native.gemm_pack(weight)
    as_f32 = linear(x, packed, 49152, out_dtype=torch.float32)
    assert as_f32.dtype == torch.float32
    assert torch.equal(as_f32, linear(x, packed, 49152).float())
    assert_one_rounding_apart(as_f32, reference_linear(x, weight))


def check_reads_strided_rows(linear):
    """Rows further apart than their length (a view into a wider tensor) give the same bits."""
    x, weight, bias = gemm_case(20, 64, 96)
    wide = torch.zeros(20, 96 + 32, dtype=torch.bfloat16)
    wide[:, :96] = x
    strided = wide[:, :96]
    assert not strided.is_contiguous()
    packed = native.gemm_pack(weight)
    got = linear(strided, packed, 64, bias)
    assert torch.equal(got, linear(x, packed, 64, bias))
    assert_one_rounding_apart(got, reference_linear(x, weight, bias))
