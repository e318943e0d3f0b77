"""GGUF files of the bench's Llama shapes (bench_gguf_8b_memory.SHAPES) quantized by llama.cpp's
own quantizer, as the files people download are made: random float weights written as an F16
GGUF, then `llama_model_quantize` (llama-cpp-python's binding of llama.cpp's quantize tool)
to Q4_K_M or Q8_0, choosing each tensor's type the way llama.cpp does. Written once to
~/.cache/pagedgen/bench, never committed.

    python bench/llama_quantized_files.py --shape 1b --ftype Q4_K_M --llama-python V/bin/python

The benches name them `llama-1b-q4_k_m` and `llama-1b-q8_0` (bench_gguf_perplexity.model_path);
the quantizer runs in the llama-cpp-python venv (this script, run there as its child).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "peers")]

from llama_cpp_peer import main_or_child, read_request, reply, run_child  # noqa: E402

FTYPES = {"Q4_K_M": 15, "Q8_0": 7}  # llama.cpp's LLAMA_FTYPE_MOSTLY_* numbers
WEIGHT_STD = 0.02  # the initialisers' scale: quantized blocks with a trained model's statistics


def quantized_path(shape_name: str, ftype: str) -> Path:
    from bench_gguf_8b_memory import BENCH_CACHE
    return BENCH_CACHE / f"llama-{shape_name}-{ftype.lower()}.gguf"


def quantized_gguf(shape_name: str, ftype: str, llama_python: str | None,
                   threads: int = 2) -> Path:
    """The file, quantized on first use (which needs llama_python: the quantizer's venv)."""
    target = quantized_path(shape_name, ftype)
    if target.exists():
        return target
    if llama_python is None:
        raise SystemExit(f"{target.name} is made by llama.cpp's quantizer: pass --llama-python")
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    source = target.with_name(f"llama-{shape_name}-f16.gguf.partial")
    partial = target.with_name(target.name + ".partial")  # renamed when whole
    try:
        write_float_file(shape_name, source)
        run_child(llama_python, __file__, {"input": str(source), "output": str(partial),
                                           "ftype": FTYPES[ftype], "threads": threads})
        partial.replace(target)
    finally:
        source.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    print(f"quantized {target} ({target.stat().st_size / 1e9:.2f} GB) with llama.cpp in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return target


def write_float_file(shape_name: str, path: Path) -> None:
    """An F16 GGUF of random N(0, WEIGHT_STD) matrices (norms 1), one tensor in memory at a time."""
    import numpy as np
    from gguf import GGUFWriter

    from bench_gguf_8b_memory import SHAPES, add_header, tensor_plan

    shape, rng = SHAPES[shape_name], np.random.default_rng(0)
    plan = tensor_plan(shape)
    writer = GGUFWriter(path, "llama")
    add_header(writer, shape)
    for name, dims, kind in plan:
        dtype = np.float32 if kind == "norm" else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in plan:
        if kind == "norm":
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            data = rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD
            writer.write_tensor_data(data.astype(np.float16))
    writer.close()


def quantize_child() -> None:
    """Runs under llama-cpp-python: llama.cpp's quantizer on the request's files."""
    import ctypes

    import llama_cpp

    request = read_request()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = request["ftype"], request["threads"]
    status = llama_cpp.llama_model_quantize(request["input"].encode(),
                                            request["output"].encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"llama_model_quantize returned {status}")
    reply({"status": status})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b", choices=("1b", "8b"))
    parser.add_argument("--ftype", default="Q4_K_M", choices=tuple(FTYPES))
    parser.add_argument("--llama-python", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(quantized_gguf(args.shape, args.ftype, args.llama_python, args.threads))


if __name__ == "__main__":
    main_or_child(main, quantize_child)
