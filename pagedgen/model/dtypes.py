"""Which floating-point type the weights and the KV cache use.

`dtype=None` (or "auto") picks, per device:
  * CUDA: bfloat16 where the GPU supports it, else float16.
  * CPU: bfloat16. Batched generation is GEMM-bound and AMX (or AVX-512 BF16) runs bf16
    GEMMs several times faster than float32 (step times: bench/FIGURES.md). float32 only
    ties at batch 1, which is not what a batch tool runs; it remains the dtype for exact
    comparisons (tests against transformers use it).
"""
from __future__ import annotations

import torch

_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
CPU_DTYPES = (torch.float32, torch.bfloat16)
CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """The torch dtype to run in; clear error for unknown names or unsupported pairs."""
    device = torch.device(device)
    if dtype is None or dtype == "auto":
        return _default_dtype(device)
    resolved = dtype if isinstance(dtype, torch.dtype) else _NAMES.get(str(dtype).removeprefix("torch."))
    if resolved is None:
        raise ValueError(f"dtype {dtype!r} is not known; use one of {sorted(_NAMES)} or 'auto'")
    allowed = CUDA_DTYPES if device.type == "cuda" else CPU_DTYPES
    if resolved not in allowed:
        raise ValueError(f"dtype {resolved} is not supported on {device.type}; "
                         f"use one of {[str(d) for d in allowed]}")
    return resolved


def _default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16
