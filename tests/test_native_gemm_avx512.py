"""The AVX-512 BF16 GEMM (kernels/cpu/gemm_avx512.c) on the shared packing, against float32
sums of the same bf16 inputs, and its dispatch in model/layers/linear.py."""
import pytest
import torch
import torch.nn.functional as F

from pagedgen.kernels.cpu import native
from pagedgen.model.layers.linear import MAX_ROWS, linear, linear_float32, pack_weight
from gemm_cases import (
    assert_one_rounding_apart, check_float32_output_is_the_bf16_result_widened,
    check_reads_strided_rows, gemm_case, reference_linear, results_at_thread_counts,
)

has_avx512_bf16 = native.load() is not None and bool(native.load().avx512_bf16_available())
needs_avx512_bf16 = pytest.mark.skipif(not has_avx512_bf16,
                                       reason="no AVX-512 BF16 on this CPU (or no C compiler)")
# every test here runs each form of the kernel, on any CPU that has it
pytestmark = pytest.mark.usefixtures("each_gemm_form")

# SmolLM2-135M's projections (qkv, o, gate_up, down) and shapes with 1, 3 (one whole column
# group) and 5 (a group and a partial one) 16-column blocks.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (16, 32), (48, 96), (80, 160)]


@needs_avx512_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 13, 16, 17, 30, 64, 100, 256])  # every M % 8
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_avx512_linear_matches_float32_sums(rows, out_features, in_features, with_bias):
    x, weight, bias = gemm_case(rows, out_features, in_features)
    bias = bias if with_bias else None
    got = native.avx512_linear(x, native.gemm_pack(weight), out_features, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert_one_rounding_apart(got, reference_linear(x, weight, bias))


@needs_avx512_bf16
@pytest.mark.parametrize("rows", [1, 17, 48])
def test_lm_head_float32_output_is_the_bf16_result_widened(rows):
    check_float32_output_is_the_bf16_result_widened(native.avx512_linear, rows)


@needs_avx512_bf16
def test_float32_output_with_bias():
    x, weight, bias = gemm_case(9, 80, 64, seed=3)
    packed = native.gemm_pack(weight)
    as_f32 = native.avx512_linear(x, packed, 80, bias, out_dtype=torch.float32)
    assert torch.equal(as_f32, native.avx512_linear(x, packed, 80, bias).float())


@needs_avx512_bf16
def test_reads_strided_rows():
    check_reads_strided_rows(native.avx512_linear)


@needs_avx512_bf16
def test_a_row_gets_the_same_bits_in_any_batch():
    # Each row's sums run in the same order whatever M is (batch-invariant by construction),
    # within each form: below the float32 form's row count, and from it on.
    wide = native.load().avx512_linear_wide_min_rows()
    x, weight, bias = gemm_case(wide + 5, 96, 128, seed=5)
    packed = native.gemm_pack(weight)
    batch = native.avx512_linear(x, packed, 96, bias)
    for row in (0, 3, wide, wide + 4):
        alone = native.avx512_linear(x[row:row + 1], packed, 96, bias)
        few = native.avx512_linear(x[row:row + 3], packed, 96, bias)
        assert torch.equal(alone[0], few[0])
        in_another_batch = native.avx512_linear(x.roll(3, 0), packed, 96, bias)
        assert torch.equal(in_another_batch[(row + 3) % (wide + 5)], batch[row])
    if native.avx512_linear_form() == 0:  # one form at every row count
        assert torch.equal(native.avx512_linear(x[:1], packed, 96, bias)[0], batch[0])


@needs_avx512_bf16
@pytest.mark.parametrize("out_features", [48, 80, 960])
def test_threads_split_columns_and_rows_without_changing_a_bit(out_features):
    # 48 / 80 outputs: fewer column groups than threads, so the rows are split too.
    x, weight, bias = gemm_case(37, out_features, 64, seed=7)
    packed = native.gemm_pack(weight)
    results = results_at_thread_counts(native.avx512_linear, x, packed, out_features, bias)
    assert all(torch.equal(results[0], other) for other in results[1:])
    assert_one_rounding_apart(results[0], reference_linear(x, weight, bias))


@needs_avx512_bf16
def test_unsupported_shapes_are_refused_and_the_layers_fall_back():
    assert native.gemm_pack(torch.randn(40, 64).to(torch.bfloat16)) is None  # 40 % 16
    assert native.gemm_pack(torch.randn(32, 48).to(torch.bfloat16)) is None  # 48 % 32
    x, weight, bias = gemm_case(5, 64, 64)
    packed = native.gemm_pack(weight)
    assert native.avx512_linear(x[:, :32], packed, 64) is None  # K does not match the packing
    assert native.avx512_linear(x.float(), packed, 64) is None  # not bf16
    assert native.avx512_linear(x, packed, 64, out_dtype=torch.float16) is None
    # The library itself declines (status 1, nothing written) a shape the packing cannot have.
    out = torch.zeros(5, 64, dtype=torch.bfloat16)
    assert native.load().avx512_linear_bf16(x.data_ptr(), 48, packed.data_ptr(), None,
                                            out.data_ptr(), 5, 64, 48, 0, 1) == 1
    assert not out.any()
    odd = torch.randn(40, 64).to(torch.bfloat16)  # the model layer keeps oneDNN (or F.linear)
    assert getattr(pack_weight(odd), "kind", None) != "avx512"
    assert_one_rounding_apart(linear(x, odd, packed=pack_weight(odd)), reference_linear(x, odd))


@needs_avx512_bf16
def test_linear_dispatch_kernel_up_to_the_crossover_f_linear_above(monkeypatch):
    if native.gemm_kind() != "avx512":
        pytest.skip("this CPU has AMX: the AMX kernel takes the packed weights")
    limit = MAX_ROWS["avx512"]
    x, weight, bias = gemm_case(limit + 1, 64, 64)
    packed = pack_weight(weight)
    assert packed.kind == "avx512"
    small = linear(x[:limit], weight, bias, packed=packed)
    assert torch.equal(small, native.avx512_linear(x[:limit], packed.data, 64, bias))
    assert torch.equal(linear(x, weight, bias, packed=packed), F.linear(x, weight, bias))
    head = linear_float32(x[:3], weight, packed=packed)
    assert torch.equal(head, native.avx512_linear(x[:3], packed.data, 64).float())
    monkeypatch.setenv("PAGEDGEN_NATIVE_GEMM", "0")  # the comparison switch: torch's oneDNN
    assert getattr(pack_weight(weight), "kind", None) in ("onednn", None)
