"""Which floating-point type the weights and the KV cache use.

`dtype=None` (or "auto") picks, per device:
  * CUDA: bfloat16 where the GPU supports it, else float16.
  * CPU that multiplies bf16 in hardware (AMX, AVX-512 BF16, Arm BF16): bfloat16. Batched
    generation is GEMM-bound and there bf16 GEMMs run several times faster than float32 (step
    times: bench/FIGURES.md). float32 only ties at batch 1, which is not what a batch tool
    runs; it remains the dtype for exact comparisons (tests against transformers use it).
  * x86 CPUs with AVX2 and FMA but no bf16 arithmetic: bfloat16 too, where our GEMM for them
    (kernels/cpu/gemm_avx2.c: bf16 weights widened in registers, float32 FMAs) is built: it
    multiplies as fast as the float32 GEMM and reads half the weight bytes, and the KV pool is
    half the size (every workload of the suite ran faster: bench/README.md, the AVX2 section).
  * Other CPUs (older Arm, x86 without that kernel): float32, since torch's bf16 GEMM there
    widens every element in memory and runs several times slower than the float32 one —
    except for a GGUF file whose blocks stay packed: its projections are the int8 kernels
    either way, and in bf16 the rest of the step (the fused decode step, a KV pool of half
    the bytes) is faster.
"""
from __future__ import annotations

import platform
from collections.abc import Callable
from functools import cache

import torch

from pagedgen.model.cpuinfo import cpuinfo_value

_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
CPU_DTYPES = (torch.float32, torch.bfloat16)
CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str,
                  packed_gguf: Callable[[], bool] = lambda: False) -> torch.dtype:
    """The torch dtype to run in; clear error for unknown names or unsupported pairs.
    packed_gguf: whether the weights are a GGUF file's blocks kept packed, asked only where
    "auto" depends on it (it may have to load the packed kernels to tell)."""
    device = torch.device(device)
    if dtype is None or dtype == "auto":
        return _default_dtype(device, packed_gguf)
    resolved = dtype if isinstance(dtype, torch.dtype) else _NAMES.get(str(dtype).removeprefix("torch."))
    if resolved is None:
        raise ValueError(f"dtype {dtype!r} is not known; use one of {sorted(_NAMES)} or 'auto'")
    allowed = CUDA_DTYPES if device.type == "cuda" else CPU_DTYPES
    if resolved not in allowed:
        raise ValueError(f"dtype {resolved} is not supported on {device.type}; "
                         f"use one of {[str(d) for d in allowed]}")
    return resolved


def _default_dtype(device: torch.device, packed_gguf: Callable[[], bool]) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if cpu_has_bf16_arithmetic() or cpu_has_bf16_gemm_kernel() or packed_gguf():
        return torch.bfloat16
    return torch.float32


def cpu_has_bf16_gemm_kernel() -> bool:
    """Whether one of our bf16 GEMMs runs here (kernels/cpu/native.py: gemm_kind): on CPUs
    without bf16 arithmetic, the AVX2 one."""
    from pagedgen.kernels.cpu import backend as cpu_backend  # builds the library on first use
    return cpu_backend.gemm_kind() is not None


@cache
def cpu_has_bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bf16 in hardware: AMX or AVX-512 BF16 on x86, the BF16
    extension on Arm. Elsewhere (AVX2-only x86, older Arm) a bf16 GEMM is widened to float32
    element by element and runs several times slower than the float32 GEMM itself."""
    if platform.machine() in ("x86_64", "AMD64", "i386", "i686"):
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return "bf16" in cpuinfo_value("Features").split()
