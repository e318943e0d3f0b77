"""Building blocks of the decoder: RMSNorm (Llama's and Gemma's) and the gated MLP (SiLU or
tanh-approximated GELU) with one fused GEMM.

Parameters are created uninitialised (torch.empty): the loader overwrites every one of them,
so random init would only cost start-up time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.kernels.cpu import backend as cpu_backend
from pagedgen.model.layers.linear import linear, pack_releasing


def empty_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32, cast back, then scale by the weight.

    Same operations in the same order (bit-identical), but in-place where a fresh tensor is
    already owned: about half the time of the textbook form on CPU in bfloat16.
    (`x32 * inv_rms` is never in place: for float32 input x32 *is* x.)
    """
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(eps))
    return (x32 * inv_rms).to(x.dtype).mul_(weight)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x * (1 + weight) all in float32, cast to x's dtype only at the end
    (transformers' Gemma3RMSNorm; the weight is stored centred on 0). On CPU in bfloat16 one
    native pass (kernels/cpu/fused_ops.c): the same operations, the sum of squares in another
    order (rarely one bf16 ulp apart); each row alone, so batch invariance holds."""
    fused = cpu_backend.add_offset_rms_norm(x, None, weight, eps)
    if fused is not None:
        return fused
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return ((x32 * inv_rms) * (1.0 + weight.float())).type_as(x)


NORMS = {"llama": rms_norm, "gemma": offset_rms_norm}  # ArchitectureStyle.norm -> function
# The residual add and the norm in one native pass, or None where it does not apply.
_FUSED_NORMS = {"llama": cpu_backend.add_rms_norm, "gemma": cpu_backend.add_offset_rms_norm}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, style: str = "llama") -> None:
        super().__init__()
        self.weight = empty_parameter(size)
        self.eps = eps
        self.style = style

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x), after the residual add x += delta (in place) when delta is given.

        On CPU in bfloat16 the add and the norm are one native pass (kernels/cpu/fused_ops.c);
        elsewhere the same operations in the same order in torch."""
        fused = _FUSED_NORMS[self.style](x, delta, self.weight, self.eps)
        if fused is not None:
            return fused
        if delta is not None:
            x.add_(delta)
        return NORMS[self.style](x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up stacked in one weight: one GEMM, not two.
    act: SiLU (Llama family) or tanh-approximated GELU (Gemma's gelu_pytorch_tanh)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_weight = empty_parameter(2 * intermediate_size, hidden_size)
        self.down_weight = empty_parameter(hidden_size, intermediate_size)
        self.gate_up_packed = self.down_packed = None  # set by pack_weights()

    def pack_weights(self, row_tiled: bool = False) -> None:
        self.gate_up_packed = pack_releasing(self, "gate_up_weight", self.gate_up_packed, row_tiled)
        self.down_packed = pack_releasing(self, "down_weight", self.down_packed, row_tiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight, packed=self.gate_up_packed)
        activated = _FUSED_ACTIVATIONS[self.activation](gate_up)  # one pass on CPU in bf16
        if activated is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            activated = _ACTIVATIONS[self.activation](gate).mul_(up)  # in place: one temporary less
        return linear(activated, self.down_weight, packed=self.down_packed)


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# act(gate) * up in one native pass, or None where it does not apply.
_FUSED_ACTIVATIONS = {"silu": cpu_backend.silu_mul, "gelu_pytorch_tanh": cpu_backend.gelu_tanh_mul}
