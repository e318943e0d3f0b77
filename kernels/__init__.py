"""Paged-KV kernels (shipped as ``pagedgen.kernels``). Imports nothing of pagedgen.

Two implementations with the same signatures (docs/contracts.md §2): ``torch_ops`` (CPU and
any device torch supports) and ``triton_ops`` (CUDA). ``reference`` is the slow test oracle.
Triton is imported only when asked for, so CPU users don't pay for it.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from . import torch_ops

__all__ = ["get_ops", "torch_ops"]


def get_ops(device: torch.device | str) -> ModuleType:
    """The kernel module for `device`: triton_ops on CUDA, torch_ops otherwise."""
    if torch.device(device).type == "cuda":
        return importlib.import_module(".triton_ops", __name__)
    return torch_ops
