"""Large CPU buffers backed by transparent huge pages where the kernel allows it.

A decode step streams the whole KV cache and all the weights from DRAM. With 4 KiB pages
that is a TLB miss (a page walk) every 4 KiB of every stream; 2 MiB pages make them rare.
Linux's default THP mode is `madvise`: only memory advised with MADV_HUGEPAGE gets huge
pages, and only if advised before it is first touched. So the big, long-lived buffers (the KV
pool, the packed weights) are allocated empty, advised, and only then written.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

import torch

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on CPU, its whole 2 MiB pages advised for huge pages (best effort)."""
    tensor = torch.empty(shape, dtype=dtype)
    if os.environ.get("PAGEDGEN_HUGE_PAGES", "1") == "0" or platform.system() != "Linux":
        return tensor
    begin = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end > begin:
        try:
            _madvise()(begin, end - begin, _MADV_HUGEPAGE)  # may fail (THP off): then 4 KiB
        except (OSError, AttributeError):
            pass
    return tensor
