"""The AVX2 bf16 GEMM (kernels/cpu/gemm_avx2.c: weights widened in registers, float32 FMAs) on
the shared packing, against float32 sums of the same bf16 inputs, and the layers that take it
on CPUs without bf16 arithmetic. The kernel runs on any x86 CPU with AVX2 and FMA, so these
run on AVX-512 and AMX machines too (where the layers pick another kernel)."""
import pytest
import torch
from torch import nn

from pagedgen.kernels.cpu import native
from pagedgen.model.layers.linear import linear, linear_float32, pack_releasing
from gemm_cases import (
    assert_one_rounding_apart, check_float32_output_is_the_bf16_result_widened,
    check_reads_strided_rows, gemm_case, reference_linear, results_at_thread_counts,
)

has_avx2 = native.load() is not None and bool(native.load().avx2_gemm_available())
pytestmark = pytest.mark.skipif(not has_avx2, reason="no AVX2 and FMA on this CPU (or no C compiler)")

# SmolLM2-135M's projections (qkv, o, gate_up, down), one and three 16-column blocks, and a
# Llama-1B-sized down projection (K = 8,192).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (16, 32), (48, 96), (64, 8192)]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 30, 100])  # every M % 4
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_avx2_linear_matches_float32_sums(rows, out_features, in_features, with_bias):
    x, weight, bias = gemm_case(rows, out_features, in_features)
    bias = bias if with_bias else None
    got = native.avx2_linear(x, native.gemm_pack(weight), out_features, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert_one_rounding_apart(got, reference_linear(x, weight, bias))


def test_more_rows_than_one_widened_slab():
    # 600 rows: two whole slabs of 256 widened rows and a part one, each overwriting the
    # buffer the previous one filled.
    x, weight, bias = gemm_case(600, 96, 128, seed=2)
    got = native.avx2_linear(x, native.gemm_pack(weight), 96, bias)
    assert_one_rounding_apart(got, reference_linear(x, weight, bias))


@pytest.mark.parametrize("rows", [1, 17, 48])
def test_lm_head_float32_output_is_the_bf16_result_widened(rows):
    check_float32_output_is_the_bf16_result_widened(native.avx2_linear, rows)


def test_rounds_to_nearest_even_as_torch_does():
    # One input of 1.0 times weights that are exactly halfway between two bf16 values once the
    # bias is added: the sums are exact, so only the rounding decides the bits.
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    weight = torch.zeros(16, 32, dtype=torch.bfloat16)
    weight[:, 0] = torch.tensor([1.0 + 2 ** -7 * k for k in range(16)]).to(torch.bfloat16)
    bias = torch.full((16,), 2 ** -8, dtype=torch.bfloat16)  # half a bf16 step at 1.0
    got = native.avx2_linear(x, native.gemm_pack(weight), 16, bias)
    expected = (weight[:, 0].float() + bias.float()).to(torch.bfloat16)
    assert torch.equal(got[0], expected)


def test_reads_strided_rows():
    check_reads_strided_rows(native.avx2_linear)


def test_a_row_gets_the_same_bits_in_any_batch():
    x, weight, bias = gemm_case(21, 96, 128, seed=5)
    packed = native.gemm_pack(weight)
    batch = native.avx2_linear(x, packed, 96, bias)
    for row in (0, 3, 8, 20):
        assert torch.equal(native.avx2_linear(x[row:row + 1], packed, 96, bias)[0], batch[row])
        in_another_batch = native.avx2_linear(x.roll(3, 0), packed, 96, bias)
        assert torch.equal(in_another_batch[(row + 3) % 21], batch[row])


@pytest.mark.parametrize("out_features", [16, 48, 960])
def test_threads_split_columns_and_rows_without_changing_a_bit(out_features):
    # 16 / 48 outputs: fewer column blocks than threads, so the rows are split too.
    x, weight, bias = gemm_case(37, out_features, 64, seed=7)
    packed = native.gemm_pack(weight)
    results = results_at_thread_counts(native.avx2_linear, x, packed, out_features, bias)
    assert all(torch.equal(results[0], other) for other in results[1:])
    assert_one_rounding_apart(results[0], reference_linear(x, weight, bias))


def test_unsupported_inputs_are_refused():
    x, weight, _ = gemm_case(5, 64, 64)
    packed = native.gemm_pack(weight)
    assert native.avx2_linear(x[:, :32], packed, 64) is None  # K does not match the packing
    assert native.avx2_linear(x.float(), packed, 64) is None  # not bf16
    out = torch.zeros(5, 64, dtype=torch.bfloat16)  # the library declines, nothing written
    assert native.load().avx2_linear_bf16(x.data_ptr(), 48, packed.data_ptr(), None,
                                          out.data_ptr(), 5, 64, 48, 0, 1) == 1
    assert not out.any()


@pytest.mark.skipif(native.gemm_kind() != "avx2", reason="this CPU's layers take another kernel")
def test_layers_hold_the_weight_once_and_take_every_row_count():
    # Without bf16 arithmetic the layers pack for this kernel and release the plain weight:
    # it takes every row count (prefill chunks too), and torch's bf16 GEMM here would be the
    # slow one it replaces.
    x, weight, bias = gemm_case(700, 64, 96, seed=4)
    layer = nn.Module()
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    packed = pack_releasing(layer, "weight", None)
    assert packed.kind == "avx2" and layer.weight.is_meta and layer.weight.shape == (0, 96)
    for rows in (1, 9, 700):
        got = linear(x[:rows], layer.weight, bias, packed=packed)
        assert torch.equal(got, native.avx2_linear(x[:rows], packed.data, 64, bias))
    head = linear_float32(x[:3], layer.weight, packed=packed)
    assert torch.equal(head, native.avx2_linear(x[:3], packed.data, 64).float())
    # an input the kernel cannot read as it is (float32 rows) is converted, not refused
    assert_one_rounding_apart(linear(x[:4].float(), layer.weight, bias, packed=packed),
                               reference_linear(x[:4], weight, bias))
    # no rows (a step where no row samples, for the LM head): an empty product, not an error
    assert linear(x[:0], layer.weight, bias, packed=packed).shape == (0, 64)
    assert linear_float32(x[:0], layer.weight, packed=packed).shape == (0, 64)
