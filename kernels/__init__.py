"""Paged-KV kernels (shipped as ``pagedgen.kernels``). Imports nothing of pagedgen.

By device: ``cpu/`` (the torch backend for CPU and any device torch supports, the C kernels and
their bindings) and ``triton/`` (CUDA), with the same signatures (docs/contracts.md §2).
Beside them what both share: ``checks`` (argument checks), ``kv_quant`` (the 8-bit KV formats)
and ``reference``, the slow test oracle. Triton is imported only when asked for.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType


def _hand_over_the_name() -> bool:
    """This folder is ``pagedgen.kernels``. Run from the repository root (``python -m pytest``,
    ``python -m pagedgen``) it also answers to the top-level name ``kernels``, which belongs to
    Hugging Face's kernels package, a dependency that transformers imports as ``kernels``: put
    that package in our place where it is installed. True when it was."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import statement returns what is here when we end
    spec.loader.exec_module(module)
    return True


if __name__ != "kernels" or not _hand_over_the_name():
    import torch

    from .cpu import backend as cpu_backend

    __all__ = ["get_ops", "cpu_backend"]

    def get_ops(device: torch.device | str) -> ModuleType:
        """The kernel module for `device`: triton.ops on CUDA, cpu_backend otherwise."""
        if torch.device(device).type == "cuda":
            return importlib.import_module(".triton.ops", __name__)
        return cpu_backend
