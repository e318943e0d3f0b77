"""The AMX GEMM (kernels/cpu/gemm_amx.c) and the packed-weight dispatch of model/layers/linear.py."""
import pytest
import torch
import torch.nn.functional as F

from pagedgen.kernels.cpu import native
from pagedgen.model.layers.linear import AMX_MAX_ROWS, linear, pack_weight
from gemm_cases import (
    assert_one_rounding_apart, check_reads_strided_rows, gemm_case, reference_linear,
)

has_amx = native.load() is not None and bool(native.load().amx_available())
needs_amx = pytest.mark.skipif(not has_amx, reason="no AMX on this CPU (or no C compiler)")


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64, 100, 256])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (48, 64), (64, 160)])
def test_amx_linear_matches_float32_sums(rows, out_features, in_features):
    # 96 outputs: pairs of 16-column blocks; 48: an odd count of blocks (the single-block loop,
    # which takes at most 64 rows); K = 160: an odd number of 32-wide input blocks.
    x, weight, _ = gemm_case(rows, out_features, in_features)
    packed = native.gemm_pack(weight)
    got = native.amx_linear(x, packed, out_features)
    if out_features == 48 and rows > 64:
        assert got is None  # declined, nothing computed: the caller uses F.linear
        return
    expected = reference_linear(x, weight)
    # Same products, another summation order: at most one bf16 rounding step apart.
    assert_one_rounding_apart(got, expected)


@needs_amx
@pytest.mark.parametrize("rows", [5, 33, 100, 200])
def test_amx_linear_over_long_inputs_sums_every_run_of_k(rows):
    # K = 4,192: two full runs of 2,048 inputs and a short one of 96, the sums kept between
    # them; a run dropped or restarted from zero is far outside the bound. 200 rows: each
    # run's activations copied first.
    x, weight, _ = gemm_case(rows, 96, 4192)
    bias = torch.randn(96).to(torch.bfloat16)
    got = native.amx_linear(x, native.gemm_pack(weight), 96, bias)
    expected = reference_linear(x, weight, bias)
    assert_one_rounding_apart(got, expected)


@needs_amx
def test_amx_linear_adds_bias_and_reads_strided_rows():
    check_reads_strided_rows(native.amx_linear)


@needs_amx
def test_linear_dispatch_amx_for_small_batches_f_linear_above():
    x, weight, _ = gemm_case(AMX_MAX_ROWS + 1, 64, 64)
    packed = pack_weight(weight)
    assert packed.kind == "amx"
    small = linear(x[:5], weight, packed=packed)
    expected = reference_linear(x[:5], weight)
    assert_one_rounding_apart(small, expected)
    assert torch.equal(linear(x, weight, packed=packed), F.linear(x, weight))


def test_unpackable_weights_use_f_linear():
    weight = torch.randn(8, 8, dtype=torch.float64)
    assert pack_weight(weight) is None  # float64: no packing for it
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    if native.load() is not None:
        assert native.gemm_pack(torch.randn(10, 64).to(torch.bfloat16)) is None  # 10 % 16 != 0


@needs_amx
@pytest.mark.parametrize("rows,out_features", [(5, 96), (64, 96), (40, 48)])
def test_amx_linear_float32_output_is_the_bf16_result_widened(rows, out_features):
    # The LM head asks for float32 logits: exactly .float() of the bf16 result, one pass.
    x, weight, _ = gemm_case(rows, out_features, 64, seed=3)
    bias = torch.randn(out_features).to(torch.bfloat16)
    packed = native.gemm_pack(weight)
    as_bf16 = native.amx_linear(x, packed, out_features, bias)
    as_f32 = native.amx_linear(x, packed, out_features, bias, out_dtype=torch.float32)
    assert as_f32.dtype == torch.float32
    assert torch.equal(as_f32, as_bf16.float())


@pytest.mark.skipif(native.load() is None, reason="no C compiler")
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (48, 96), (64, 2048)])
def test_packing_puts_each_column_block_s_input_pairs_in_order(out_features, in_features):
    # gemm_common.h's layout, built here from the plain weight: per block of 16 columns, pair p
    # of every column (one 32-bit word of its row), pairs in order.
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    words = weight.view(torch.int32)  # [n, k / 2]: word p holds inputs 2p, 2p + 1
    expected = words.reshape(out_features // 16, 16, in_features // 2).transpose(1, 2)
    packed = native.gemm_pack(weight)
    assert torch.equal(packed.reshape(-1).view(torch.int32), expected.reshape(-1))
