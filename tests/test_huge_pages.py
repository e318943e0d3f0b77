"""Big CPU buffers (KV pool, packed weights) are advised for transparent huge pages."""
from pathlib import Path

import pytest
import torch

from pagedgen.model.huge_pages import empty_huge
from pagedgen.model.kv_cache import allocate_kv_cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of /proc/self/smaps that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            begin, end = (int(x, 16) for x in head.split("-"))
            inside = begin <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no THP here")
def test_buffer_is_backed_by_huge_pages_once_written():
    buffer = empty_huge((16 << 20,), torch.uint8).fill_(1)
    middle = buffer.data_ptr() + (8 << 20)
    assert _huge_kib_at(middle) >= 2048
    assert int(buffer.sum()) == 16 << 20


def test_switch_off_and_shapes(monkeypatch):
    monkeypatch.setenv("PAGEDGEN_HUGE_PAGES", "0")
    small = empty_huge((3, 5), torch.bfloat16)
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16


def test_cpu_kv_pool_is_zeroed():
    pool = allocate_kv_cache(2, 8, 16, 3, 64, torch.bfloat16, "cpu")
    assert pool.shape == (2, 2, 8, 16, 3, 64) and not bool(pool.any())
