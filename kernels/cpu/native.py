"""Build-on-first-use loader for the C kernels, one shared library: decode attention
(decode_attention.c, decode_attention_bf16.c, decode_attention_avx2.c), the fused bf16
elementwise ops (fused_ops.c), the KV row store (store_kv.c), the skinny bf16 GEMMs (gemm_amx.c,
gemm_avx512.c, gemm_avx2.c: AMX, else AVX-512 BF16, else AVX2 and FMA, one weight packing for
all three) and prefill attention
(prefill_attention_amx.c, prefill_attention_avx512.c, the latter also over 8-bit pools, and
prefill_attention_avx2.c).

The shared library is compiled once per machine with the system C compiler and cached under
$PAGEDGEN_CACHE_DIR (default ~/.cache/pagedgen) keyed by a hash of the source, the flags and
the CPU, so a second process loads it in milliseconds. The cache is private and each library
is checked against the digest recorded at its build before it is loaded (native_cache.py).
Anything that goes wrong (no compiler, a bad or incomplete library, unsupported shape) makes
the caller fall back to the pure-torch path with one warning: the native kernel is a speed-up,
never a requirement. PAGEDGEN_NATIVE_KERNELS=0 turns it off; PAGEDGEN_FLOAT32_FMA=0/1 pins the
form of the AVX-512 BF16 GEMM and prefill attention (VDPBF16PS or float32 FMAs).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import torch

from . import native_cache
from .bindings import FUNCTIONS

SOURCES = [Path(__file__).with_name(name)
           for name in ("decode_attention.c", "decode_attention_bf16.c",
                        "decode_attention_avx2.c", "decode_attention_q8.c", "fused_ops.c",
                        "store_kv.c", "store_kv_q8.c", "gemm_amx.c", "gemm_avx512.c",
                        "gemm_avx2.c",
                        "decode_step.c",
                        "prefill_attention_amx.c",
                        "prefill_attention_avx512.c", "prefill_attention_avx2.c")]
HEADERS = [Path(__file__).with_name(name)  # part of the cache key
           for name in ("decode_shapes.h", "team_ops.h", "decode_scores_amx.h",
                        "decode_shared_amx.h", "decode_units.h",
                        "decode_bf16_blocks.h", "decode_bf16_passes.h",
                        "decode_shared_blocks.h", "x86_common.h", "kv_codes.h", "gemm_common.h",
                        "gemm_micro_tiles.h", "amx_column_pair.h", "prefill_items.h")]
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]


def enabled() -> bool:
    return os.environ.get("PAGEDGEN_NATIVE_KERNELS", "1") != "0"


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
        model = next((line for line in text.splitlines() if line.startswith("model name")), "")
        return model + flags
    except OSError:
        return platform.processor()


def library_name(compiler: str) -> str:
    key = hashlib.sha256(b"\0".join(
        [*(source.read_bytes() for source in SOURCES + HEADERS), " ".join(FLAGS).encode(),
         compiler.encode(), _cpu_id().encode()]
    )).hexdigest()[:16]
    return f"pagedgen-cpu-{key}.so"


def _compile(compiler: str, target: Path) -> None:
    """One compiler process per source, as many at once as there are cores, then one link:
    the specialised kernels make single files take tens of seconds, and on a busy machine one
    serial build of all of them ran past any reasonable limit."""
    compile_flags = [flag for flag in FLAGS if flag != "-shared"]
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:
        objects = [Path(folder) / f"{source.stem}.o" for source in SOURCES]
        commands = [[compiler, *compile_flags, "-c", "-o", str(obj), str(source)]
                    for source, obj in zip(SOURCES, objects)]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(_run_compiler, commands))  # list(): a failed compile raises here
        _run_compiler([compiler, *FLAGS, "-o", str(target), *map(str, objects), "-lm"])


def _run_compiler(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)


class MissingSymbolError(OSError):
    """The library lacks a function this module calls (a foreign or stale build)."""


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    for name, signature in FUNCTIONS.items():
        try:
            function = getattr(library, name)
        except AttributeError:
            raise MissingSymbolError(f"the native library lacks the function {name}") from None
        function.argtypes, function.restype = signature.argtypes, ctypes.c_int
    return library


def _with_forms_from_environment(library: ctypes.CDLL) -> ctypes.CDLL:
    """The AVX-512 BF16 kernels' forms, chosen now, in one thread, before any parallel region
    asks: PAGEDGEN_FLOAT32_FMA=0 keeps them on VDPBF16PS, =1 puts them on float32 FMAs, on any
    CPU (for comparisons, and for the same bits on CPUs of different kinds); unset, as timed
    on this one."""
    form = os.environ.get("PAGEDGEN_FLOAT32_FMA")
    chosen = int(form) if form in ("0", "1") else -2
    library.prefill_attention_avx512_form(chosen)
    library.avx512_linear_form(chosen)
    return library


def first_error_line(error: Exception) -> str:
    """One line that says why: a compiler's whole output would bury the run's own messages."""
    lines = [line.strip() for line in (getattr(error, "stderr", None) or "").splitlines()]
    lines = [line for line in lines if line]
    flagged = [line for line in lines if "error:" in line.lower()]   # gcc, clang, ld
    if flagged or lines:
        return (flagged or lines)[0]
    return (str(error).splitlines() or [type(error).__name__])[0]


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (with one warning) when it cannot be had."""
    if not enabled():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        path = native_cache.library_folder() / library_name(compiler)
        if not native_cache.is_verified(path):   # missing, corrupt, or not what we built
            native_cache.build_verified(path, lambda tmp: _compile(compiler, tmp))
        return _with_forms_from_environment(_bind(ctypes.CDLL(str(path))))
    except (OSError, subprocess.SubprocessError) as error:
        warnings.warn(f"pagedgen: native CPU attention unavailable, using torch "
                      f"({first_error_line(error)}); set PAGEDGEN_NATIVE_KERNELS=0 to silence")
        return None


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor, sliding_window: int = 0,
                     share_blocks: bool = True) -> bool:
    """Attention of one query token per sequence, K/V read in place through the tables.

    query: [S, H_q, D] with heads and D contiguous (rows may be strided: a view of the fused
    QKV output); out: contiguous [S, H_q, D]; k_cache/v_cache: contiguous [N, B, H_kv, D]; tables
    int64 [S, max_blocks]; seq_lens int64 [S]. float32 or bfloat16. sliding_window W > 0: the
    query (at position seq_len - 1) sees the last W keys; blocks before them are not read.
    share_blocks: neighbours whose tables begin with the same blocks (parallel samples, requests
    behind one cached prompt) are attended together, those blocks read once for all (bf16); a
    row's last bit can then depend on its neighbours. False: every row alone (batch invariance).
    Returns False (and leaves `out` untouched) when the native kernel is unavailable or the
    case is unsupported.
    """
    library = load()
    if library is None or not _supported(query, k_cache, v_cache, block_tables, seq_lens, out):
        return False
    num_seqs, num_q_heads, head_dim = query.shape
    status = library.paged_decode_attention(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_q_heads,
        k_cache.shape[2], head_dim, k_cache.shape[1], scale,
        int(query.dtype == torch.bfloat16), sliding_window, int(share_blocks),
        torch.get_num_threads())
    return status == 0


_KV_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def kv_code(dtype: torch.dtype) -> int | None:
    """The C kernels' number for an 8-bit pool's code dtype (DecodeAttention.kv_codes), else None."""
    return _KV_CODES.get(dtype)


def decode_attention_q8(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        k_scales: torch.Tensor, v_scales: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                        out: torch.Tensor, sliding_window: int = 0) -> bool:
    """decode_attention over an 8-bit pool (kernels/kv_quant.py): k_cache/v_cache hold int8 or
    float8 codes [N, B, H_kv, D], k_scales/v_scales contiguous float32 [N, H_kv]; query and out
    float32 or bfloat16. False (out untouched) where it does not apply."""
    library = load()
    codes = _KV_CODES.get(k_cache.dtype)
    if library is None or codes is None or v_cache.dtype != k_cache.dtype:
        return False
    if not (query.dtype in (torch.float32, torch.bfloat16) and out.dtype == query.dtype
            and _rows_strided(query) and query.is_cpu and out.is_cpu and out.is_contiguous()):
        return False
    if not all(t.is_cpu and t.is_contiguous() for t in (k_cache, v_cache, k_scales, v_scales,
                                                       block_tables, seq_lens)):
        return False
    if not (k_scales.dtype == v_scales.dtype == torch.float32
            and block_tables.dtype == seq_lens.dtype == torch.int64):
        return False
    num_seqs, num_q_heads, head_dim = query.shape
    status = library.paged_decode_attention_q8(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scales.data_ptr(), v_scales.data_ptr(), codes, block_tables.data_ptr(),
        block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_q_heads,
        k_cache.shape[2], head_dim, k_cache.shape[1], scale,
        int(query.dtype == torch.bfloat16), sliding_window, torch.get_num_threads())
    return status == 0


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      blocks: torch.Tensor, context_len: int, scale: float,
                      out: torch.Tensor, sliding_window: int = 0) -> bool:
    """Causal attention of one prefill chunk (bf16): query [q_len, H_q, D] rows at the last
    q_len positions of a context of context_len tokens whose K/V are in the cache blocks
    `blocks` (int64); writes contiguous `out` [q_len, H_q, D]; sliding_window W > 0: the row at
    p sees keys (p - W, p] and nothing before the first row's window is read. The AMX kernel where
    the CPU has AMX, else the AVX-512 BF16 one, else the AVX2 one. False (nothing written) where
    none applies (other CPUs, dtypes or head sizes)."""
    library = load()
    if library is None or query.dtype != torch.bfloat16 or not _rows_strided(query):
        return False
    if not (_bf16_cpu(k_cache, v_cache, out) and out.shape == query.shape and k_cache.dim() == 4
            and k_cache.shape == v_cache.shape and blocks.dtype == torch.int64
            and blocks.is_contiguous() and blocks.is_cpu and query.is_cpu):
        return False
    q_len, num_q_heads, head_dim = query.shape
    block_size = k_cache.shape[1]
    if not 0 < q_len <= context_len <= blocks.numel() * block_size:
        return False
    args = (query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            blocks.data_ptr(), context_len, q_len, out.data_ptr(), num_q_heads, k_cache.shape[2],
            head_dim, block_size, scale, sliding_window, torch.get_num_threads())
    # each returns 1 (nothing written) where its CPU features or the shape do not fit
    return (library.prefill_attention_bf16(*args) == 0
            or library.prefill_attention_avx512_bf16(*args) == 0
            or library.prefill_attention_avx2_bf16(*args) == 0)


def prefill_attention_q8(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         k_scales: torch.Tensor, v_scales: torch.Tensor, blocks: torch.Tensor,
                         context_len: int, scale: float, out: torch.Tensor,
                         sliding_window: int = 0) -> bool:
    """prefill_attention over an 8-bit pool (kernels/kv_quant.py): k_cache/v_cache int8 or
    float8 codes [N, B, H_kv, D], k_scales/v_scales contiguous float32 [N, H_kv]; bf16 query
    and out. The AVX-512 BF16 kernel decodes the codes in place (on AMX CPUs too); False
    (nothing written) where it does not apply."""
    library = load()
    codes = _KV_CODES.get(k_cache.dtype)
    if library is None or codes is None or v_cache.dtype != k_cache.dtype:
        return False
    if query.dtype != torch.bfloat16 or not _rows_strided(query) or not query.is_cpu:
        return False
    if not (_bf16_cpu(out) and out.shape == query.shape and k_cache.dim() == 4
            and k_cache.shape == v_cache.shape and blocks.dtype == torch.int64):
        return False
    if not all(t.is_cpu and t.is_contiguous() for t in (k_cache, v_cache, k_scales, v_scales,
                                                       blocks)):
        return False
    if not (k_scales.dtype == v_scales.dtype == torch.float32
            and k_scales.shape == v_scales.shape == (k_cache.shape[0], k_cache.shape[2])):
        return False
    q_len, num_q_heads, head_dim = query.shape
    block_size = k_cache.shape[1]
    if not 0 < q_len <= context_len <= blocks.numel() * block_size:
        return False
    return library.prefill_attention_avx512_q8(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scales.data_ptr(), v_scales.data_ptr(), codes, blocks.data_ptr(), context_len, q_len,
        out.data_ptr(), num_q_heads, k_cache.shape[2], head_dim, block_size, scale,
        sliding_window, torch.get_num_threads()) == 0


def prefill_attention_path(num_q_heads: int, num_kv_heads: int, head_dim: int) -> str:
    """Which kernel runs bf16 prefill attention of this shape here: "AMX", "AVX-512 BF16"
    (VDPBF16PS), "AVX-512 BF16, float32 FMA" (where VDPBF16PS multiplies slower than float32
    FMAs, as timed by the library), "AVX2" (float32 FMAs on widened K/V), or "torch sdpa" (the
    gather + SDPA fallback)."""
    library = load()
    if library is None:
        return "torch sdpa"
    if library.prefill_attention_supported(num_q_heads, num_kv_heads, head_dim):
        return "AMX"
    if library.prefill_attention_avx512_supported(num_q_heads, num_kv_heads, head_dim):
        return "AVX-512 BF16" + (", float32 FMA" if prefill_attention_form() else "")
    if library.prefill_attention_avx2_supported(num_q_heads, num_kv_heads, head_dim):
        return "AVX2"
    return "torch sdpa"


def decode_unit_form(form: int = -2) -> int:
    """How bf16 decode attention runs units of sequences that share blocks: 1 on the AMX tile
    unit where the CPU has it (the default), 0 on vector passes. -2 reads it; 0 or 1 sets it
    (the tests run both forms on AMX CPUs)."""
    library = load()
    return 0 if library is None else library.decode_attention_unit_form(form)


DECODE_KERNELS = ("fastest", "avx2", "portable")


def decode_kernel(choice: str | None = None) -> str:
    """Which kernels bf16 decode attention may take: "fastest" (the default: AVX-512 BF16, else
    AVX2, else the portable loop), "avx2" (not the AVX-512 ones), "portable" (the loop alone).
    None reads the setting. For the tests (every kernel the CPU can run) and the benchmarks."""
    library = load()
    if library is None:
        return "portable"
    return DECODE_KERNELS[library.decode_attention_kernel(
        -2 if choice is None else DECODE_KERNELS.index(choice))]


def prefill_attention_form(form: int = -2) -> int:
    """The AVX-512 BF16 prefill kernel's form: 1 float32 FMAs on widened K/V, 0 VDPBF16PS.
    -2 reads it (timed on this CPU at the first use), -1 times it again, 0 or 1 sets it (the
    tests run each form on any CPU with AVX-512 BF16)."""
    library = load()
    return 0 if library is None else library.prefill_attention_avx512_form(form)


def _supported(query, k_cache, v_cache, block_tables, seq_lens, out) -> bool:
    # Called once per layer and step: plain attribute checks, no generators (they showed up
    # in profiles of small decode steps).
    dtype = query.dtype
    if dtype not in (torch.float32, torch.bfloat16) or not _rows_strided(query):
        return False
    if not (k_cache.dtype == v_cache.dtype == out.dtype == dtype
            and block_tables.dtype == seq_lens.dtype == torch.int64):
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()
            and block_tables.is_contiguous() and seq_lens.is_contiguous()):
        return False
    return (query.is_cpu and k_cache.is_cpu and v_cache.is_cpu and block_tables.is_cpu
            and seq_lens.is_cpu and out.is_cpu)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Copy K/V row t into cache slot slot_mapping[t] (-1: skip). key/value [T, H_kv, D] may
    have strided rows (each its own stride); caches contiguous [N, B, H_kv, D]. False (nothing
    written) when the native path does not apply; ValueError for a slot past the cache."""
    library = load()
    if library is None or key.shape != value.shape or slot_mapping.dtype != torch.int64:
        return False
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype and key.is_cpu
            and value.is_cpu and k_cache.is_cpu and v_cache.is_cpu and slot_mapping.is_cpu):
        return False
    if not (_rows_strided(key) and _rows_strided(value) and k_cache.is_contiguous()
            and v_cache.is_contiguous() and slot_mapping.is_contiguous()):
        return False
    size, capacity = key.element_size(), k_cache.shape[0] * k_cache.shape[1]
    status = library.store_kv_rows(key.data_ptr(), key.stride(0) * size, value.data_ptr(),
                                   value.stride(0) * size, k_cache.data_ptr(), v_cache.data_ptr(),
                                   slot_mapping.data_ptr(), key.shape[0], key[0].numel() * size,
                                   capacity)
    if status != 0:
        raise ValueError(f"slot_mapping has a slot past the cache's {capacity} slots")
    return True


def store_kv_q8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor,
                slot_mapping: torch.Tensor) -> bool:
    """kv_quant.store_kv_quantized for a decode step: every touched block gets ONE token (the
    caller checks). key/value float32 or bf16 [T, H_kv, D] (rows may be strided); codes and
    scales contiguous on CPU. False (nothing written) where it does not apply; ValueError for
    a slot past the cache."""
    codes = _KV_CODES.get(k_cache.dtype)
    if not k_cache.is_cpu or codes is None or key.shape != value.shape or key.dtype != value.dtype:
        return False  # checked before load(): a CUDA pool never compiles the CPU library
    if key.dtype not in (torch.float32, torch.bfloat16) or slot_mapping.dtype != torch.int64:
        return False
    library = load()
    if library is None:
        return False
    tensors = (key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)
    if not (all(t.is_cpu for t in tensors) and _rows_strided(key) and _rows_strided(value)
            and all(t.is_contiguous() for t in tensors[2:])):
        return False
    size, (num_blocks, block_size, heads, dim) = key.element_size(), k_cache.shape
    status = library.store_kv_q8(key.data_ptr(), key.stride(0) * size, value.data_ptr(),
                                 value.stride(0) * size, int(key.dtype == torch.bfloat16),
                                 k_cache.data_ptr(), v_cache.data_ptr(), k_scales.data_ptr(),
                                 v_scales.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
                                 heads, dim, block_size, num_blocks * block_size, codes)
    if status != 0:
        raise ValueError(f"slot_mapping has a slot past the cache's {num_blocks * block_size} slots")
    return True


def gemm_kind() -> str | None:
    """The skinny bf16 GEMM this CPU runs on packed weights: "amx", "avx512" (AVX-512 BF16,
    no AMX), "avx2" (AVX2 and FMA, no bf16 arithmetic: widened in registers), or None (no such
    CPU, no native library, or PAGEDGEN_NATIVE_GEMM=0, which leaves the projections to torch
    for comparisons)."""
    library = load()
    if library is None or os.environ.get("PAGEDGEN_NATIVE_GEMM", "1") == "0":
        return None
    if library.amx_available():
        return "amx"
    if library.avx512_bf16_available():
        return "avx512"
    return "avx2" if library.avx2_gemm_available() else None


def gemm_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The [N, K] bf16 weight repacked for the GEMM kernels (gemm_common.h: AMX tiles,
    which are VDPBF16PS operands too), or None when the shape (N % 16, K % 32) or the native
    library does not allow it."""
    library = load()
    if library is None or weight.dim() != 2 or not _bf16_cpu(weight):
        return None
    n, k = weight.shape
    packed = torch.empty(n * k, dtype=torch.bfloat16)
    if library.amx_pack_weight(weight.data_ptr(), n, k, packed.data_ptr()) != 0:
        return None
    return packed


def amx_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """x @ W.T (+ bias) for bf16 x [M, K] (rows may be strided) and W packed by gemm_pack, on
    AMX; None (nothing computed) when the native path does not apply. out_dtype float32 gives
    the same bf16-rounded values widened (what `.float()` of the bf16 result would give)."""
    return _packed_linear("amx_linear_bf16", x, packed, out_features, bias, out_dtype)


def avx512_linear_form(form: int = -2) -> int:
    """The AVX-512 BF16 GEMM's form for calls of many rows: 1 float32 FMAs on widened inputs
    (where VDPBF16PS multiplies slower), 0 VDPBF16PS only. -2 reads it (timed on this CPU at
    the first use), -1 times it again, 0 or 1 sets it (the tests run each on any CPU)."""
    library = load()
    return 0 if library is None else library.avx512_linear_form(form)


def avx512_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """amx_linear with VDPBF16PS (gemm_avx512.c) on the same packing: CPUs with AVX-512
    BF16; None (nothing computed) where it does not apply."""
    return _packed_linear("avx512_linear_bf16", x, packed, out_features, bias, out_dtype)


def avx2_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """amx_linear with float32 FMAs on weights widened in registers (gemm_avx2.c), same
    packing: CPUs with AVX2 and FMA; None (nothing computed) where it does not apply."""
    return _packed_linear("avx2_linear_bf16", x, packed, out_features, bias, out_dtype)


def _packed_linear(kernel: str, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    library = load()
    if library is None or x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cpu:
        return None
    rows, k = x.shape
    if x.stride(1) != 1 or packed.numel() != out_features * k:
        return None
    if bias is not None and not (_bf16_cpu(bias) and bias.shape == (out_features,)):
        return None
    if out_dtype not in (torch.bfloat16, torch.float32):
        return None
    out = torch.empty(rows, out_features, dtype=out_dtype)
    if rows == 0:  # a step whose rows all skip this product (none samples, say): nothing to do
        return out
    status = getattr(library, kernel)(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                      None if bias is None else bias.data_ptr(), out.data_ptr(),
                                      rows, out_features, k, int(out_dtype == torch.float32),
                                      torch.get_num_threads())
    return out if status == 0 else None


def _rows_strided(x: torch.Tensor) -> bool:
    """[rows, heads, D] with heads and D packed, the rows any distance apart."""
    if x.dim() != 3:
        return False
    return x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]


def _bf16_cpu(*tensors: torch.Tensor) -> bool:
    for t in tensors:  # a loop, not all(genexpr): this runs several times per layer and step
        if not (t.dtype == torch.bfloat16 and t.is_cpu and t.is_contiguous()):
            return False
    return True


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """hidden += delta (in place), then RMSNorm(hidden) * weight, in one pass (bf16 only).

    Returns the normed tensor, or None (nothing changed) when the native path does not apply."""
    library = load()
    tensors = (hidden, weight) if delta is None else (hidden, delta, weight)
    if library is None or hidden.dim() != 2 or not _bf16_cpu(*tensors):
        return None
    if delta is not None and delta.shape != hidden.shape:
        return None
    out = torch.empty_like(hidden)
    library.add_rms_norm_bf16(hidden.data_ptr(), None if delta is None else delta.data_ptr(),
                              weight.data_ptr(), out.data_ptr(), hidden.shape[0], hidden.shape[1],
                              eps, torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """SiLU(gate) * up for gate_up = [gate | up] rows (bf16 only), or None when not applicable."""
    return _gated(gate_up, "silu_mul_bf16")


def _gated(gate_up: torch.Tensor, kernel: str) -> torch.Tensor | None:
    """act(gate) * up by a native kernel taking (gate_up, out, rows, inter, threads)."""
    library = load()
    if library is None or gate_up.dim() != 2 or not _bf16_cpu(gate_up):
        return None
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    getattr(library, kernel)(gate_up.data_ptr(), out.data_ptr(), rows, width // 2,
                             torch.get_num_threads())
    return out


def add_offset_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> torch.Tensor | None:
    """Gemma's RMSNorm (x * (1 + weight), float32 throughout), after hidden += delta in place
    when delta is given; bf16 only, else None (nothing changed). hidden is [rows, D]
    contiguous, or (no delta) [rows, heads, D] with the rows strided (q/k heads inside the
    QKV output) and weight [D] or one row per head [heads, D]. The result is contiguous."""
    library = load()
    if library is None or hidden.dtype != torch.bfloat16 or not hidden.is_cpu \
            or not _bf16_cpu(weight):
        return None
    if hidden.dim() == 2 and hidden.is_contiguous():
        (outer, dim), inner, outer_stride = hidden.shape, 1, hidden.shape[1]
    elif delta is None and _rows_strided(hidden):
        (outer, inner, dim), outer_stride = hidden.shape, hidden.stride(0)
    else:
        return None
    if weight.shape == (dim,) or weight.shape == (1, dim):
        weight_stride = 0
    elif weight.shape == (inner, dim):
        weight_stride = dim
    else:
        return None
    if delta is not None and (delta.shape != hidden.shape or not _bf16_cpu(delta)):
        return None
    out = torch.empty(hidden.shape, dtype=hidden.dtype)
    library.add_offset_rms_norm_bf16(hidden.data_ptr(), outer_stride,
                                     None if delta is None else delta.data_ptr(),
                                     weight.data_ptr(), weight_stride, out.data_ptr(), outer, inner,
                                     dim, eps, torch.get_num_threads())
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """GELU_tanh(gate) * up for gate_up = [gate | up] rows (bf16 only), or None."""
    return _gated(gate_up, "gelu_tanh_mul_bf16")


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x.max(dim=-1).indices of a float32 [rows, cols] CPU tensor (first index on ties, NaN
    wins), in one native pass per row; None where it does not apply. torch's reduction reads
    a 262k-token vocabulary at a fraction of the memory bandwidth."""
    library = load()
    if library is None or x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu \
            or not x.is_contiguous() or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library.argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(),
                            torch.get_num_threads())
    return out


def rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding of x [T, heads, D] (rows may be strided, heads and D contiguous) by
    cos_sin [T, 2, D/2], bit-identical to model.rope.apply_rope; bf16 only, else None."""
    library = load()
    if library is None or x.dim() != 3 or cos_sin.dim() != 3:
        return None
    tokens, heads, head_dim = x.shape
    inner_contiguous = x.stride(2) == 1 and x.stride(1) == head_dim
    if not (inner_contiguous and _bf16_cpu(cos_sin) and x.dtype == torch.bfloat16
            and x.is_cpu and cos_sin.shape == (tokens, 2, head_dim // 2)):
        return None
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype)
    library.rope_bf16(x.data_ptr(), x.stride(0), cos_sin.data_ptr(), out.data_ptr(), tokens,
                      heads, head_dim, torch.get_num_threads())
    return out
