"""KV cache sizing arithmetic and the one start-up allocation (layout: docs/contracts.md §1).

The sizing functions allocate nothing, so `inspect-memory` can answer "how many blocks would
fit" without loading a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagedgen.kernels.kv_quant import KV_CACHE_DTYPES, SCALE_DTYPE, kv_format  # noqa: F401 - re-exported
from pagedgen.model.runtime.lazy_zeros import lazy_zeros
from pagedgen.settings import default

# Without an explicit size: a fixed budget on CPU, a share of free memory on CUDA. On CPU a
# fraction of free memory meant several GB of zero-filled pool for a small model on a machine
# shared with the OS and other processes, while 1 GiB already holds tens of thousands of tokens
# of a small model; a GPU is the process's own, so it takes most of what the weights left.
DEFAULT_KV_MEMORY_BYTES = 2**30
DEFAULT_KV_MEMORY_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    num_blocks: int
    budget_bytes: int   # the bytes asked for (num_blocks x bytes per block when given blocks)
    source: str         # where the size came from, for messages and inspect-memory


def dtype_bytes(dtype: torch.dtype | str) -> int:
    return _as_dtype(dtype).itemsize


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype | str, kv_cache_dtype: str = default("kv_cache_dtype"),
                       block_size: int = default("block_size")) -> int:
    """K and V of one token over all layers: 2 * layers * kv_heads * head_dim * dtype bytes.

    A quantized kv_cache_dtype stores 1-byte codes plus one float32 scale per block, K/V and
    KV head; a token carries 1 / block_size of its block's scales, rounded up to a whole
    byte (so a pool sized from it never overshoots its budget).
    """
    fmt = kv_format(kv_cache_dtype)
    if fmt is None:
        return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes(dtype)
    codes = 2 * num_layers * num_kv_heads * head_dim * fmt.storage.itemsize
    return codes + -(-kv_scale_bytes_per_block(num_layers, num_kv_heads) // block_size)


def kv_scale_bytes_per_block(num_layers: int, num_kv_heads: int) -> int:
    """The scales of one block of a quantized pool: float32 per layer, K/V and KV head."""
    return 2 * num_layers * num_kv_heads * SCALE_DTYPE.itemsize


def kv_bytes_per_block(bytes_per_token: int, block_size: int) -> int:
    return bytes_per_token * block_size


def blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks fit in `budget_bytes` (may be 0)."""
    if budget_bytes < 0:
        raise ValueError(f"kv memory budget must be >= 0 bytes, got {budget_bytes}")
    return budget_bytes // kv_bytes_per_block(bytes_per_token, block_size)


def available_memory_bytes(device: torch.device | str) -> int:
    """Free memory now: torch.cuda.mem_get_info on CUDA, MemAvailable of /proc/meminfo on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return _meminfo_available()


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the file counts kB
    raise RuntimeError(f"{path} has no MemAvailable line; pass num_blocks or kv_memory")


def size_kv_pool(*, bytes_per_token: int, block_size: int, device: torch.device | str,
                 num_blocks: int | None = None, kv_memory_bytes: int | None = None,
                 kv_memory_fraction: float | None = None, check_available: bool = True,
                 reserved_bytes: int = 0) -> KVPoolSize:
    """The one rule that sizes the KV pool, from at most one of: num_blocks, a byte budget, a
    fraction of free memory; with none, the device's default (see DEFAULT_KV_MEMORY_BYTES).

    check_available: refuse, before anything is allocated, a pool larger than the memory
    available now, naming the largest pool that fits (inspect-memory sizes hypothetical pools
    and turns it off).
    reserved_bytes: memory the run will take that is not resident yet, so free memory does not
    show it (weights mapped from a file, paged in by the first steps); set aside before a
    fraction is taken or a pool is judged to fit.
    """
    given = [name for name, value in (("num_blocks", num_blocks), ("kv_memory_bytes", kv_memory_bytes),
                                      ("kv_memory_fraction", kv_memory_fraction)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of num_blocks, kv_memory, kv_memory_fraction; got {given}")
    per_block = kv_bytes_per_block(bytes_per_token, block_size)
    if num_blocks is not None:
        pool = KVPoolSize(num_blocks, num_blocks * per_block, f"num_blocks={num_blocks}")
    else:
        budget, source = _budget(kv_memory_bytes, kv_memory_fraction, device, reserved_bytes)
        pool = KVPoolSize(blocks_for_budget(budget, block_size, bytes_per_token), budget, source)
        if pool.num_blocks < 1:
            raise ValueError(f"{source} gives {budget} bytes, less than one KV block ({per_block} bytes "
                             f"= {block_size} tokens x {bytes_per_token} bytes/token)")
    if check_available and kv_memory_fraction is None:
        _refuse_oversize(pool, per_block, device, reserved_bytes)
    return pool


def _free_for_kv(device: torch.device | str, reserved_bytes: int) -> tuple[int, str]:
    """Free memory less the reserve, and how to say it."""
    free = available_memory_bytes(device)
    if reserved_bytes <= 0:
        return free, f"the {free} bytes available on {device}"
    return (max(0, free - reserved_bytes),
            f"the {free} bytes available on {device} less {reserved_bytes} bytes of mapped "
            "weights not resident yet")


def _budget(kv_memory_bytes: int | None, kv_memory_fraction: float | None,
            device: torch.device | str, reserved_bytes: int = 0) -> tuple[int, str]:
    if kv_memory_bytes is not None:
        return kv_memory_bytes, f"kv_memory={kv_memory_bytes}"
    device_type = torch.device(device).type
    if kv_memory_fraction is None and device_type != "cuda":
        return DEFAULT_KV_MEMORY_BYTES, f"the default {DEFAULT_KV_MEMORY_BYTES >> 20} MiB on {device_type}"
    fraction = DEFAULT_KV_MEMORY_FRACTION if kv_memory_fraction is None else kv_memory_fraction
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {fraction!r}")
    free, said = _free_for_kv(device, reserved_bytes)
    return int(free * fraction), f"kv_memory_fraction={fraction} of {said}"


def _refuse_oversize(pool: KVPoolSize, per_block: int, device: torch.device | str,
                     reserved_bytes: int = 0) -> None:
    """A pool that cannot fit would fail late (an out-of-memory kill on CPU, mid-allocation on
    CUDA); say at once what does fit instead."""
    need = pool.num_blocks * per_block
    available, said = _free_for_kv(device, reserved_bytes)
    if need <= available:
        return
    fits = available // per_block
    raise ValueError(f"the KV pool ({pool.source}: {pool.num_blocks} blocks, {need} bytes) is larger than "
                     f"{said}; the largest pool that fits is "
                     f"{fits} blocks ({fits * per_block} bytes): lower num_blocks / kv_memory")


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The one pool for all layers: [L, 2, num_blocks, B, H_kv, D], zero-filled.

    Zeros, not torch.empty: the CPU kernels gather whole blocks (block tails past seq_len,
    padded table entries) and mask them in the softmax, but 0 * NaN is NaN — recycled memory
    holding inf/NaN bit patterns (e.g. a freed -inf attention mask) turned whole batches of
    logits into NaN. Once zeroed, every value in the pool stays finite.

    On CPU the zeros are pages fresh from the kernel (lazy_zeros.py): resident only once written,
    so the process's memory follows the KV in use rather than the pool's size.
    """
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return _zeros(shape, dtype, device)


def allocate_kv_scales(num_layers: int, num_blocks: int, num_kv_heads: int,
                       device: torch.device | str) -> torch.Tensor:
    """The scales beside a quantized pool: float32 [L, 2, num_blocks, H_kv], zero-filled."""
    return _zeros((num_layers, 2, num_blocks, num_kv_heads), SCALE_DTYPE, device)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type == "cpu":
        return lazy_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_storage_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The pool's element dtype: the model's for "auto", the format's 8-bit codes otherwise."""
    fmt = kv_format(kv_cache_dtype)
    return model_dtype if fmt is None else fmt.storage


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype name")
    return resolved
