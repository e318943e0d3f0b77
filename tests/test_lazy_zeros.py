"""The CPU KV pool reads as zeros yet is resident only where written."""
import os

import pytest
import torch

from pagedgen.model.runtime.kv_cache import allocate_kv_cache, allocate_kv_scales
from pagedgen.model.runtime.lazy_zeros import lazy_zeros

linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
MIB = 2**20


def resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mapped_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


@linux_only
def test_a_pool_becomes_resident_only_where_written():
    before = resident_bytes()
    # 30 layers x K/V x 1024 blocks x 16 tokens x 3 heads x 64 x bf16 = 360 MiB
    pool = allocate_kv_cache(30, 1024, 16, 3, 64, torch.bfloat16, "cpu")
    assert pool.shape == (30, 2, 1024, 16, 3, 64) and pool.dtype == torch.bfloat16
    assert pool.is_contiguous() and pool.data_ptr() % 64 == 0
    assert resident_bytes() - before < 64 * MIB          # torch.zeros: +360 MiB here
    assert torch.count_nonzero(pool) == 0                # reading maps the zero page only
    assert resident_bytes() - before < 64 * MIB
    pool[:, :, :8] = 1.0                                 # 8 of 1024 blocks in every layer
    assert resident_bytes() - before < 64 * MIB
    assert int(torch.count_nonzero(pool)) == 30 * 2 * 8 * 16 * 3 * 64


@linux_only
def test_the_mapping_lives_as_long_as_the_tensor():
    before = mapped_bytes()
    pool = lazy_zeros((64, MIB), torch.float32)            # 256 MiB
    view = pool[3]
    del pool
    view.fill_(2.0)                                        # still mapped: a view holds it
    assert float(view.sum()) == 2.0 * MIB
    assert mapped_bytes() - before >= 200 * MIB
    del view
    assert mapped_bytes() - before < 64 * MIB              # unmapped with its last tensor


def test_quantized_scales_and_empty_shapes_are_zero_tensors():
    scales = allocate_kv_scales(2, 5, 3, "cpu")
    assert scales.shape == (2, 2, 5, 3) and scales.dtype == torch.float32
    assert torch.count_nonzero(scales) == 0
    assert lazy_zeros((0, 4), torch.bfloat16).shape == (0, 4)
