"""Build and load the packed-GGUF GEMM libraries: one source (gguf_gemm.c) compiled once per
kernel path, each with its own target flags, so every path is exactly what its name says and
the AVX2 and portable ones can be built and tested on a CPU that has more.

Libraries are cached privately like the other kernels (kernels/cpu/native_cache.py), keyed by
the source, the flags and the compiler. `load_path(name)` builds one path (raising on
failure: tests use it, and must fail when a library is missing); `best()` picks the widest
path this CPU runs, and returns None with one warning when nothing can be built (the model
then falls back to dequantized weights).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .. import native_cache

SOURCE = Path(__file__).with_name("gguf_gemm.c")
# Files SOURCE includes: part of the library's cache key.
INCLUDED = tuple(Path(__file__).with_name(name)
                 for name in ("gguf_registers.c", "gguf_avx512.c", "gguf_avx2.c",
                              "gguf_bf16_tiles.c", "gguf_amx_tiles.c")) + tuple(
    Path(__file__).parent.parent / name
    for name in ("x86_common.h", "gemm_common.h", "gemm_micro_tiles.h"))
COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-fno-strict-aliasing"]
# Path name -> its own target flags; the number is the path's id for gguf_cpu_supports().
PATH_FLAGS = {
    "portable": (0, []),
    "avx2": (1, ["-mavx2", "-mfma", "-mf16c"]),
    "avx512_vnni": (2, ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                        "-mavx512vnni", "-mavx512dq"]),
    "avx512_bf16": (3, ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                        "-mavx512vnni", "-mavx512dq", "-mavx512bf16"]),
    "amx_bf16": (4, ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                     "-mavx512vnni", "-mavx512dq", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]),
}
PREFERENCE = ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx2", "portable")
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "gguf_gemm": [_INT, _PTR, _I64, _PTR, _I64, _I64, _PTR, _INT, _I64, _I64, _PTR, _I64, _INT,
                  _I64, _INT],
    "gguf_dequantize_rows": [_INT, _PTR, _I64, _PTR, _I64, _I64, _PTR, _INT, _I64, _INT],
    "gguf_cpu_supports": [_INT],
}


class GgufKernelUnavailable(OSError):
    """A kernel path could not be built or loaded here."""


@dataclass(frozen=True, slots=True)
class GgufLibrary:
    path: str  # "amx_bf16", "avx512_bf16", "avx512_vnni", "avx2" or "portable"
    library: ctypes.CDLL
    bf16_tiles: bool = False  # the library has the bf16 tile GEMM (gguf_has_bf16_tiles)


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_name(path: str, cc: str) -> str:
    flags = " ".join(COMMON_FLAGS + PATH_FLAGS[path][1])
    sources = [source.read_bytes() for source in (SOURCE, *INCLUDED)]
    key = hashlib.sha256(b"\0".join([*sources, flags.encode(), cc.encode()])).hexdigest()
    return f"pagedgen-gguf-{path}-{key[:16]}.so"


def _compile(cc: str, path: str, target: Path) -> None:
    flags = COMMON_FLAGS + PATH_FLAGS[path][1]
    subprocess.run([cc, *flags, "-o", str(target), str(SOURCE), "-lm"], check=True,
                   capture_output=True, text=True, timeout=180)


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    library.gguf_path_name.argtypes, library.gguf_path_name.restype = [], ctypes.c_char_p
    library.gguf_decodes_in_registers.argtypes = []
    library.gguf_decodes_in_registers.restype = ctypes.c_int
    library.gguf_has_bf16_tiles.argtypes, library.gguf_has_bf16_tiles.restype = [], ctypes.c_int
    library.gguf_bf16_tiles_form.argtypes = [ctypes.c_int]
    library.gguf_bf16_tiles_form.restype = ctypes.c_int
    library.gguf_linear_scratch_bytes.argtypes = [_I64, _I64]
    library.gguf_linear_scratch_bytes.restype = ctypes.c_int64
    library.gguf_linear_team.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR]
    library.gguf_linear_team.restype = None
    return library


@lru_cache(maxsize=None)
def load_path(path: str) -> GgufLibrary:
    """The library of one kernel path (built on first use); GgufKernelUnavailable if not."""
    if path not in PATH_FLAGS:
        raise ValueError(f"unknown GGUF kernel path {path!r}; known: {', '.join(PATH_FLAGS)}")
    cc = compiler()
    if cc is None:
        raise GgufKernelUnavailable("no C compiler (set CC or install gcc)")
    try:
        target = native_cache.library_folder() / library_name(path, cc)
        if not native_cache.is_verified(target):
            native_cache.build_verified(target, lambda tmp: _compile(cc, path, tmp))
        library = _bind(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError, AttributeError) as error:
        detail = (getattr(error, "stderr", None) or str(error)).strip().splitlines()
        raise GgufKernelUnavailable(f"GGUF kernel path {path}: "
                                    f"{detail[0] if detail else type(error).__name__}") from error
    if library.gguf_path_name().decode() != path:
        raise GgufKernelUnavailable(f"library built for {path} reports "
                                    f"{library.gguf_path_name().decode()} (flags not honoured)")
    tiles = bool(library.gguf_has_bf16_tiles())
    if tiles and library.gguf_cpu_supports(PATH_FLAGS[path][0]):
        choose_tiles_form(library)
    return GgufLibrary(path, library, tiles)


def choose_tiles_form(library: ctypes.CDLL) -> int:
    """The bf16 tiles' form (1: float32 FMAs, 0: VDPBF16PS), chosen now, in one thread, before
    any team asks: PAGEDGEN_FLOAT32_FMA=0/1 pins it, else it is timed on this CPU."""
    form = os.environ.get("PAGEDGEN_FLOAT32_FMA")
    return library.gguf_bf16_tiles_form(int(form) if form in ("0", "1") else -2)


def cpu_supports(path: str) -> bool:
    """Whether this CPU can run `path` (asked of the portable library, which runs anywhere)."""
    return bool(load_path("portable").library.gguf_cpu_supports(PATH_FLAGS[path][0]))


def forced_path() -> str | None:
    """PAGEDGEN_GGUF_PATH=avx2 (say) pins the path, for benchmarks and comparisons."""
    return os.environ.get("PAGEDGEN_GGUF_PATH") or None


@lru_cache(maxsize=1)
def best() -> GgufLibrary | None:
    """The widest path this CPU runs, or None with one warning when none can be built."""
    try:
        wanted = forced_path()
        if wanted is not None:
            return load_path(wanted)
        return load_path(next(path for path in PREFERENCE if cpu_supports(path)))
    except GgufKernelUnavailable as error:
        warnings.warn(f"pagedgen: packed GGUF kernels unavailable ({error}); GGUF weights "
                      "will be dequantized at load instead")
        return None
