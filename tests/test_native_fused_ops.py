"""The fused bf16 elementwise C ops (kernels/cpu/fused_ops.c) against torch's op sequence."""
import pytest
import torch
import torch.nn.functional as F

from pagedgen.kernels.cpu import native
from pagedgen.model.layers.norm_mlp import RMSNorm, rms_norm

needs_native = pytest.mark.skipif(native.load() is None, reason="no C compiler here")


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_native
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (130, 96)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(rows, dim, with_delta):
    hidden, delta = _bf16(rows, dim), _bf16(rows, dim, seed=1)
    weight = (torch.rand(dim, generator=torch.Generator().manual_seed(2)) + 0.5).bfloat16()
    expected_hidden = hidden.clone()
    if with_delta:
        expected_hidden.add_(delta)
    expected = rms_norm(expected_hidden, weight, 1e-5)
    got = native.add_rms_norm(hidden, delta if with_delta else None, weight, 1e-5)
    assert torch.equal(hidden, expected_hidden)  # the residual add, in place, bit for bit
    # The norm's sum runs in another order: at most one bf16 ulp apart, rarely.
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2 ** -7)
    assert (got != expected).float().mean() < 0.01


@needs_native
def test_silu_mul_matches_torch():
    gate_up = _bf16(33, 2 * 160)
    gate, up = gate_up.split(160, dim=-1)
    assert torch.equal(native.silu_mul(gate_up), F.silu(gate) * up)


def _gemma_norm_float64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm written out in float64: x / rms(x) * (1 + weight), rounded once."""
    x64 = x.double()
    return (x64 * (x64.square().mean(-1, keepdim=True) + eps).rsqrt() * (1 + weight.double())).to(x.dtype)


@needs_native
@pytest.mark.parametrize("rows,dim", [(1, 64), (9, 640), (130, 96)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_gemma_norm_matches_its_definition(rows, dim, with_delta):
    hidden, delta = _bf16(rows, dim), _bf16(rows, dim, seed=1)
    weight = _bf16(dim, seed=2) * 0.3            # Gemma's weights are centred on 0
    expected_hidden = hidden.clone()
    if with_delta:
        expected_hidden.add_(delta)
    got = native.add_offset_rms_norm(hidden, delta if with_delta else None, weight, 1e-6)
    assert torch.equal(hidden, expected_hidden)  # the residual add, in place, bit for bit
    expected = _gemma_norm_float64(expected_hidden, weight, 1e-6)
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2 ** -7)
    assert (got != expected).float().mean() < 0.01


@needs_native
def test_gemma_q_and_k_norms_read_heads_inside_the_qkv_rows():
    # q and k heads are a strided view of the QKV output; each head kind has its own weight row.
    tokens, heads, head_dim = 7, 5, 256
    qkv = _bf16(tokens, (heads + 2) * head_dim)
    qk = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    weight = _bf16(heads, head_dim, seed=3) * 0.3
    got = native.add_offset_rms_norm(qk, None, weight, 1e-6)
    assert got.is_contiguous() and got.shape == qk.shape
    expected = _gemma_norm_float64(qk, weight, 1e-6)
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2 ** -7)


@needs_native
def test_gelu_tanh_mul_matches_its_definition():
    gate_up = _bf16(33, 2 * 160) * 4             # past the tanh's saturation on both sides
    gate, up = gate_up.double().split(160, dim=-1)
    tanh = torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3))
    gelu = (0.5 * gate * (1 + tanh)).bfloat16().double()
    expected = (gelu * up).bfloat16()
    got = native.gelu_tanh_mul(gate_up)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), expected.float(), atol=2 ** -20, rtol=2 ** -7)
    # One bf16 ulp apart, rarely (the float rounding of the inner terms); where tanh(y) is -1
    # in float (gate below about -5.2) the kernel gives torch's exact 0, float64 a tiny value.
    gate_bf16 = gate_up[:, :160]
    assert (got != expected)[gate_bf16 > -5].float().mean() < 0.01
    assert (got[gate_bf16 < -6].float() == 0).all()


@needs_native
@pytest.mark.parametrize("cols", [50_000, 1, 17, 100, 200])
def test_argmax_rows_is_torchs_max_indices(cols):
    logits = torch.randn(7, cols, generator=torch.Generator().manual_seed(4))
    last = cols - 1
    logits[1, last // 3], logits[1, last] = 100.0, 100.0      # a tie: the first index
    logits[2, last] = float("nan")               # NaN wins, as in torch
    logits[3] = float("-inf")                    # every token banned: index 0
    logits[4] = -1.0
    logits[4, last], logits[4, last // 2] = 0.0, -0.0   # -0 and +0 tie
    logits[5, -1] = float("inf")
    logits[6] = 5.0                              # all equal: 0, whatever lane holds the rest
    got = native.argmax_rows(logits)
    assert torch.equal(got, logits.max(dim=-1).indices)
    assert got.tolist()[:5] == [int(logits[0].argmax()), last // 3, last, 0, last // 2]
    assert got.tolist()[6] == 0


def test_fused_ops_decline_what_they_do_not_handle():
    x32 = torch.randn(4, 8)
    assert native.add_rms_norm(x32, None, torch.ones(8), 1e-5) is None
    assert native.silu_mul(x32) is None
    bf16_3d = _bf16(2, 3, 8)
    assert native.silu_mul(bf16_3d) is None
    assert native.gelu_tanh_mul(x32) is None and native.argmax_rows(x32.bfloat16()) is None
    assert native.add_offset_rms_norm(x32, None, torch.ones(8), 1e-6) is None
    assert native.add_offset_rms_norm(bf16_3d, bf16_3d, _bf16(8), 1e-6) is None  # no add on heads
    assert native.add_offset_rms_norm(bf16_3d, None, _bf16(4, 8), 1e-6) is None  # rows != heads


def test_rms_norm_module_adds_the_residual_on_every_path():
    norm = RMSNorm(16, 1e-6)
    norm.weight.data.fill_(1.0)
    for dtype in (torch.float32, torch.bfloat16):
        norm.weight.data = norm.weight.data.to(dtype)
        hidden, delta = torch.ones(2, 16, dtype=dtype), torch.full((2, 16), 2.0, dtype=dtype)
        out = norm(hidden, delta)
        assert torch.equal(hidden, torch.full((2, 16), 3.0, dtype=dtype))
        torch.testing.assert_close(out.float(), torch.ones(2, 16), atol=1e-2, rtol=0)


@needs_native
@pytest.mark.parametrize("heads,head_dim", [(12, 64), (5, 16)])
def test_rope_matches_torch_bit_for_bit_on_a_strided_view(heads, head_dim):
    from pagedgen.model.layers import rope
    tokens = 9
    fused_qkv = _bf16(tokens, heads * head_dim + 40)  # rows wider than the q/k part
    x = fused_qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2) * 6
    cos_sin = torch.stack((angles.cos(), angles.sin()), dim=1).bfloat16()
    got = native.rope(x, cos_sin)
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos_sin[:, None, 0], cos_sin[:, None, 1]
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    assert torch.equal(got, expected)
    assert torch.equal(rope.apply_rope(x, cos_sin), expected)
