"""Paged-KV kernels (shipped as ``pagedgen.kernels``). Imports nothing of pagedgen.

By device: ``cpu/`` (the torch backend for CPU and any device torch supports, the C kernels and
their bindings) and ``triton/`` (CUDA), with the same signatures (docs/contracts.md §2).
Beside them what both share: ``checks`` (argument checks), ``kv_quant`` (the 8-bit KV formats)
and ``reference``, the slow test oracle. Triton is imported only when asked for.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from .cpu import backend as cpu_backend

__all__ = ["get_ops", "cpu_backend"]


def get_ops(device: torch.device | str) -> ModuleType:
    """The kernel module for `device`: triton.ops on CUDA, cpu_backend otherwise."""
    if torch.device(device).type == "cuda":
        return importlib.import_module(".triton.ops", __name__)
    return cpu_backend
