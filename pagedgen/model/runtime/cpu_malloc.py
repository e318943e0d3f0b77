"""Keep freed activation memory in the process on CPU, instead of returning it to the kernel.

torch's CPU allocator is glibc malloc. A prefill step allocates and frees tens of megabytes of
activations per layer; with glibc's defaults much of it is returned to the kernel on free
(munmap, heap trim) and faulted back in, zero-filled, on the next allocation: page faults and
prefill time both drop with these settings (figures: bench/FIGURES.md). Raising the mmap and trim
thresholds makes glibc reuse that memory. Peak RSS stays bounded by the largest step's working
set (freed memory is reused, not leaked). Process-wide, so it is done once, on glibc only, and
PAGEDGEN_MALLOC_TUNING=0 leaves malloc alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD = 1 << 30  # blocks below this come from the reusable heap
_TRIM_THRESHOLD = 1 << 30    # free heap top kept before it is given back
_TOP_PAD = 64 << 20          # heap growth per brk call
_done = False


def keep_freed_memory() -> bool:
    """Apply the thresholds once; True when glibc took them."""
    global _done
    if _done or os.environ.get("PAGEDGEN_MALLOC_TUNING", "1") == "0":
        return _done
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = all(libc.mallopt(param, value) == 1 for param, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
            (_M_TOP_PAD, _TOP_PAD)))
    except (OSError, AttributeError):
        return False
    return _done
