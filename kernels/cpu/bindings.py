"""The C functions of the native library as one typed table: each function's parameters by
name and C type, in the order of its definition in kernels/cpu/*.c. Every function returns int
(0: done; the rest is the function's own: 1 unsupported, a flag for the *_available ones).

native.py binds the library from this table (ctypes argtypes); tests/test_native_bindings.py
parses the C definitions and checks that this table names the same parameters with the same
types, so an edit to a C signature that is not made here fails a test instead of a call.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

# The C types the entry points use, and how ctypes passes them.
CTYPES = {"ptr": ctypes.c_void_p, "int64_t": ctypes.c_int64, "int": ctypes.c_int,
          "float": ctypes.c_float}


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    ctype: str  # a key of CTYPES; "ptr" for any pointer


@dataclass(frozen=True, slots=True)
class CFunction:
    name: str
    params: tuple[Param, ...]

    @property
    def argtypes(self) -> list[type]:
        return [CTYPES[param.ctype] for param in self.params]


def _function(name: str, spec: str) -> CFunction:
    """spec: "type name, type name, ..." as in C, pointers written as ptr."""
    pairs = (item.split() for item in spec.split(",") if item.strip())
    return CFunction(name, tuple(Param(name=param, ctype=ctype) for ctype, param in pairs))


_DECODE_SHAPE = ("int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, "
                 "int block_size, float scale, int is_bf16, int sliding_window, int num_threads")
_PREFILL_TAIL = ("ptr table, int64_t context_len, int64_t q_len, ptr out, int num_q_heads, "
                 "int num_kv_heads, int head_dim, int block_size, float scale, "
                 "int sliding_window, int num_threads")
_PREFILL = "ptr q, int64_t q_stride, ptr k_cache, ptr v_cache, " + _PREFILL_TAIL
_LINEAR = ("ptr x, int64_t x_stride, ptr packed, ptr bias, ptr out, int64_t m, int64_t n, "
           "int64_t k, int out_f32, int num_threads")
_HEADS = "int num_q_heads, int num_kv_heads, int head_dim"

FUNCTIONS = {f.name: f for f in (
    _function("paged_decode_attention",
              "ptr q, int64_t q_stride, ptr k_cache, ptr v_cache, ptr block_tables, "
              "int64_t max_blocks, ptr seq_lens, ptr out, int num_seqs, int num_q_heads, "
              "int num_kv_heads, int head_dim, int block_size, float scale, int is_bf16, "
              "int sliding_window, int share_blocks, int num_threads"),
    _function("paged_decode_attention_q8",
              "ptr q, int64_t q_stride, ptr k_cache, ptr v_cache, ptr k_scales, ptr v_scales, "
              "int kv_codes, ptr block_tables, int64_t max_blocks, ptr seq_lens, ptr out, "
              + _DECODE_SHAPE),
    _function("store_kv_q8",
              "ptr key, int64_t key_stride_bytes, ptr value, int64_t value_stride_bytes, "
              "int is_bf16, ptr k_cache, ptr v_cache, ptr k_scales, ptr v_scales, ptr slots, "
              "int64_t rows, int64_t heads, int64_t dim, int64_t block_size, int64_t capacity, "
              "int kv_codes"),
    _function("store_kv_rows",
              "ptr key, int64_t key_stride_bytes, ptr value, int64_t value_stride_bytes, "
              "ptr k_cache, ptr v_cache, ptr slots, int64_t rows, int64_t row_bytes, "
              "int64_t capacity"),
    _function("amx_available", ""),
    _function("amx_pack_weight", "ptr w, int64_t n, int64_t k, ptr out"),
    _function("amx_linear_bf16", _LINEAR),
    _function("avx512_bf16_available", ""),
    _function("avx512_linear_bf16", _LINEAR),
    _function("avx512_linear_form", "int form"),
    _function("avx512_linear_wide_min_rows", ""),
    _function("avx2_gemm_available", ""),
    _function("avx2_linear_bf16", _LINEAR),
    _function("add_rms_norm_bf16",
              "ptr residual, ptr delta, ptr weight, ptr out, int64_t rows, int64_t dim, "
              "float eps, int num_threads"),
    _function("silu_mul_bf16", "ptr gate_up, ptr out, int64_t rows, int64_t inter, "
                               "int num_threads"),
    _function("add_offset_rms_norm_bf16",
              "ptr residual, int64_t outer_stride, ptr delta, ptr weight, int64_t weight_stride, "
              "ptr out, int64_t outer, int64_t inner, int64_t dim, float eps, int num_threads"),
    _function("gelu_tanh_mul_bf16", "ptr gate_up, ptr out, int64_t rows, int64_t inter, "
                                    "int num_threads"),
    _function("argmax_rows_f32", "ptr x, int64_t rows, int64_t cols, ptr out, int num_threads"),
    _function("prefill_attention_bf16", _PREFILL),
    _function("prefill_attention_avx512_bf16", _PREFILL),
    _function("prefill_attention_avx2_bf16", _PREFILL),
    _function("prefill_attention_avx512_q8",
              "ptr q, int64_t q_stride, ptr k_cache, ptr v_cache, ptr k_scales, ptr v_scales, "
              "int codes, " + _PREFILL_TAIL),
    _function("prefill_attention_supported", _HEADS),
    _function("prefill_attention_avx512_supported", _HEADS),
    _function("prefill_attention_avx2_supported", _HEADS),
    _function("prefill_attention_avx512_form", "int form"),
    _function("decode_attention_unit_form", "int form"),
    _function("decode_attention_kernel", "int choice"),
    _function("decode_layers_bf16",
              "ptr layers, int num_layers, ptr shape, ptr buffers, int num_threads"),
    _function("rope_bf16",
              "ptr x, int64_t row_stride, ptr cos_sin, ptr out, int64_t tokens, int64_t heads, "
              "int64_t head_dim, int num_threads"),
)}
