"""Zero-filled CPU tensors whose memory becomes resident only where it is written.

The KV pool is sized for the most the engine may ever hold, yet a job often fills a fraction of
it. torch.zeros writes every byte at start-up, so the whole pool is resident (RSS, PSS) from the
first step. Pages fresh from the kernel are zero already and are backed by physical memory only
when first written, so a pool over a private anonymous mapping reads as zeros everywhere (every
value finite, which the kernels need: they read whole blocks and mask the tail) while the
process's memory follows the KV actually used. Reads of untouched pages map the kernel's shared
zero page and stay non-resident too. The trade: unwritten memory is not reserved either, so
another process may take it meanwhile; the pool's size is still checked against the memory
available at start-up (kv_cache.size_kv_pool).

Not calloc / numpy.zeros: with the malloc tuning of cpu_malloc.py, allocations below its mmap
threshold come from the heap, where recycled memory must be cleared by writing it.
"""
from __future__ import annotations

import math
import mmap
import os

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros over its own anonymous mapping (torch.zeros where there
    is no POSIX mmap). The tensor holds the mapping; it is unmapped when the tensor is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or os.name != "posix":
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
