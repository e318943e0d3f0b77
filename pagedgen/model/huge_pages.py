"""Large CPU buffers backed by transparent huge pages where the kernel allows it.

A decode step streams the whole KV cache and all the weights from DRAM. With 4 KiB pages
that is a TLB miss (a page walk) every 4 KiB of every stream; 2 MiB pages make them rare
(decode attention over 30 layers of KV, batch 64 x context 300, 2 threads: 23.3 -> 20.2 ms).
Linux's default THP mode is `madvise`: only memory advised with MADV_HUGEPAGE gets huge
pages, and only where it was not touched before the advice. malloc'ed memory may be recycled
(touched) heap, so these buffers get a fresh anonymous mapping of their own, 2 MiB aligned,
advised before anything is written to it.
"""
from __future__ import annotations

import mmap
import os

import torch

_HUGE_PAGE = 2 << 20


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on its own mapping advised for huge pages (best effort: where
    that is not possible, or PAGEDGEN_HUGE_PAGES=0, a plain torch.zeros)."""
    count = 1
    for size in shape:
        count *= size
    nbytes = count * dtype.itemsize
    if (nbytes < _HUGE_PAGE or os.environ.get("PAGEDGEN_HUGE_PAGES", "1") == "0"
            or not hasattr(mmap, "MADV_HUGEPAGE")):
        return torch.zeros(shape, dtype=dtype)
    try:
        # Private and anonymous: zero-filled, untouched (a shared mapping would be shmem,
        # which THP's `madvise` mode leaves on 4 KiB pages).
        mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.zeros(shape, dtype=dtype)
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -address % _HUGE_PAGE  # start on a huge-page boundary
    # The tensor keeps the mapping alive; it is unmapped when the tensor is freed.
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(shape)
