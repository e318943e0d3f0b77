"""Compile every Triton kernel for a GPU target ahead of time, no GPU needed.

    python tools/compile_check.py [--arch 90] [--quick]

The CPU interpreter accepts things the GPU compiler rejects (tl.dot shape limits, dtype
rules); this runs the real compiler down to a cubin (ptxas ships with the triton wheel)
for the configurations triton_ops launches. Run it without TRITON_INTERPRET set.
"""
from __future__ import annotations

import argparse
import os
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedgen.kernels.triton.attention_kernel import paged_attention_kernel
from pagedgen.kernels.triton.cache_kernels import copy_blocks_kernel, store_kv_kernel

ATTENTION_POINTERS = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")
# (GROUP, GROUP_PAD, BLOCK_Q, HEAD_DIM): SmolLM2 decode and prefill tiles, Llama-8B prefill.
ATTENTION_SHAPES = [(3, 4, 4, 64), (3, 4, 16, 64), (4, 4, 16, 128)]


def compile_kernel(kernel, types: dict[str, str], constants: dict[str, object], arch: int):
    signature = {name: "constexpr" if name in constants else types.get(name, "i32")
                 for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(n),): v for n, v in constants.items()}
    source = ASTSource(kernel, signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


def attention_jobs(quick: bool):
    dtypes = (("bf16", "tf32"),) if quick else (("bf16", "tf32"), ("fp32", "ieee"))
    for dtype, precision in dtypes:
        types = dict.fromkeys(ATTENTION_POINTERS, f"*{dtype}")
        for group, group_pad, block_q, head_dim in ATTENTION_SHAPES:
            constants = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
                             HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16,
                             TILE_N=64, COMPUTE_FP32=False, DOT_PRECISION=precision)
            yield paged_attention_kernel, _attention_types(types), {**constants, "QUANTIZED": False}
    # Quantized pools (bf16 queries on 8-bit codes); --quick: the decode tile only.
    for codes in ("i8", "fp8e4nv", "fp8e5"):
        types = dict(q_ptr="*bf16", out_ptr="*bf16", k_cache_ptr=f"*{codes}",
                     v_cache_ptr=f"*{codes}")
        for group, group_pad, block_q, head_dim in ATTENTION_SHAPES[:1 if quick else 3]:
            constants = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
                             HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16, TILE_N=64,
                             COMPUTE_FP32=False, DOT_PRECISION="tf32", QUANTIZED=True)
            yield paged_attention_kernel, _attention_types(types), constants


def _attention_types(pointers: dict[str, str]) -> dict[str, str]:
    return {**pointers, "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
            "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
            "qk_scale": "fp32"}


def cache_jobs():
    store_types = dict.fromkeys(("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr"), "*bf16")
    yield store_kv_kernel, {**store_types, "slot_ptr": "*i32"}, dict(
        HEAD_DIM=64, ROW=192, ROW_PAD=256, TOKENS=16)
    yield copy_blocks_kernel, dict(cache_ptr="*bf16", src_ptr="*i64", dst_ptr="*i64"), dict(
        CHUNK=4096)


def main() -> None:
    parser = argparse.ArgumentParser(description="compile the Triton kernels for a GPU arch")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10")
    parser.add_argument("--quick", action="store_true",
                        help="bf16 attention only (float32 with ieee dots compiles slowly)")
    opts = parser.parse_args()
    arch = opts.arch
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    for kernel, types, constants in [*attention_jobs(opts.quick), *cache_jobs()]:
        start = time.perf_counter()
        compiled = compile_kernel(kernel, types, constants, arch)
        print(f"{kernel.__name__:24s} sm_{arch} {time.perf_counter() - start:5.1f}s "
              f"shared={compiled.metadata.shared}B {constants}")


if __name__ == "__main__":
    main()
