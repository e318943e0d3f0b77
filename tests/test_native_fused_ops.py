"""The fused bf16 elementwise C ops (kernels/cpu_fused_ops.c) against torch's op sequence."""
import pytest
import torch
import torch.nn.functional as F

from pagedgen.kernels import native
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


def test_fused_ops_decline_what_they_do_not_handle():
    x32 = torch.randn(4, 8)
    assert native.add_rms_norm(x32, None, torch.ones(8), 1e-5) is None
    assert native.silu_mul(x32) is None
    bf16_3d = _bf16(2, 3, 8)
    assert native.silu_mul(bf16_3d) is None


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
