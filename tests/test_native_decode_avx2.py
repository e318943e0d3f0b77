"""The AVX2 bf16 decode-attention kernel (kernels/cpu/decode_attention_avx2.c) against float32
attention of the same bf16 inputs: within one bf16 rounding of the output, for every shape it
is specialised for. Runs on any x86 CPU with AVX2 and FMA (the AVX-512 kernels skipped)."""
import pytest
import torch

from pagedgen.kernels import reference
from pagedgen.kernels.cpu import native
from test_native_attention import _decode_case

has_avx2 = native.load() is not None and bool(native.load().avx2_gemm_available())
pytestmark = pytest.mark.skipif(not has_avx2,
                                reason="no AVX2 and FMA on this CPU (or no C compiler)")


@pytest.fixture(autouse=True)
def avx2_kernel():
    taken = native.decode_kernel()
    native.decode_kernel("avx2")
    yield
    native.decode_kernel(taken)


def _float32_attention(query, k_cache, v_cache, tables, lens, scale, window=0):
    return reference.paged_attention(query.float(), k_cache.float(), v_cache.float(), tables.int(),
                                     lens.int(), torch.arange(len(lens) + 1, dtype=torch.int32),
                                     scale, sliding_window=window)


def _assert_one_rounding_apart(got, expected):
    # float32 sums in another order, one rounding of the output to bf16.
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=2e-4)


# (head_dim, query heads per kv head): every specialisation, 8 keys per hadd tree down to 1
@pytest.mark.parametrize("head_dim,group", [(64, 1), (64, 2), (64, 3), (64, 4), (64, 8),
                                            (128, 1), (128, 2), (128, 4), (128, 8),
                                            (256, 1), (256, 2), (256, 4)])
@pytest.mark.parametrize("block_size", [8, 16, 20])
def test_matches_float32_attention_of_the_same_bf16_inputs(head_dim, group, block_size):
    # Lengths up to 200: many blocks, and partial 8-key chunks at block ends (block 20).
    query, k_cache, v_cache, tables, lens = _decode_case(5, 2 * group, 2, head_dim, block_size,
                                                         torch.bfloat16, seed=head_dim + group,
                                                         max_len=200)
    out = torch.full_like(query, float("nan"))
    scale = head_dim ** -0.5
    assert native.decode_attention(query, k_cache, v_cache, tables, lens, scale, out)
    expected = _float32_attention(query, k_cache, v_cache, tables, lens, scale)
    _assert_one_rounding_apart(out, expected)


@pytest.mark.parametrize("window", [1, 7, 16, 37])
def test_a_sliding_window_masks_the_keys_before_it(window):
    query, k_cache, v_cache, tables, lens = _decode_case(6, 4, 1, 256, 16, torch.bfloat16,
                                                         seed=window, max_len=120)
    out = torch.empty_like(query)
    assert native.decode_attention(query, k_cache, v_cache, tables, lens, 0.0625, out, window)
    expected = _float32_attention(query, k_cache, v_cache, tables, lens, 0.0625, window)
    _assert_one_rounding_apart(out, expected)


def test_large_scores_do_not_overflow_the_softmax():
    # Scores in the hundreds: the exp sees only score - max <= 0; a key far above the others
    # takes all the weight.
    query, k_cache, v_cache, tables, lens = _decode_case(3, 3, 3, 64, 16, torch.bfloat16,
                                                         max_len=90)
    query = (query * 40).to(torch.bfloat16)
    out = torch.empty_like(query)
    assert native.decode_attention(query, k_cache, v_cache, tables, lens, 1.0, out)
    assert torch.isfinite(out.float()).all()
    _assert_one_rounding_apart(out, _float32_attention(query, k_cache, v_cache, tables, lens, 1.0))


def test_a_row_gets_the_same_bits_in_any_batch():
    query, k_cache, v_cache, tables, lens = _decode_case(7, 9, 3, 64, 16, torch.bfloat16,
                                                         max_len=150)
    batch = torch.empty_like(query)
    assert native.decode_attention(query, k_cache, v_cache, tables, lens, 0.125, batch)
    for row in (0, 4, 6):
        alone = torch.empty_like(query[:1])
        assert native.decode_attention(query[row:row + 1], k_cache, v_cache, tables[row:row + 1],
                                       lens[row:row + 1], 0.125, alone)
        assert torch.equal(alone[0], batch[row])
