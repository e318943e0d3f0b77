"""Paged-KV kernels (shipped as ``pagedgen.kernels``). Imports nothing of pagedgen.

Two implementations with the same signatures (docs/contracts.md §2): ``cpu_backend`` (CPU and
any device torch supports) and ``triton_ops`` (CUDA). ``reference`` is the slow test oracle.
Triton is imported only when asked for, so CPU users don't pay for it.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from . import cpu_backend

__all__ = ["get_ops", "cpu_backend"]


def get_ops(device: torch.device | str) -> ModuleType:
    """The kernel module for `device`: triton_ops on CUDA, cpu_backend otherwise."""
    if torch.device(device).type == "cuda":
        return importlib.import_module(".triton_ops", __name__)
    return cpu_backend
