"""ctypes mirrors of kernels/cpu/decode_step.c's structs: same names, same fields, same order
(tests/test_native_bindings.py checks them against the C). The model side that fills them is
pagedgen/model/layers/fused_decode.py."""
from __future__ import annotations

import ctypes

_ptr = ctypes.c_void_p

GEMM_KINDS = {"amx": 0, "avx512": 1}  # decode_step.c's GEMM_AMX, GEMM_AVX512

# DecodeStepBuffers' scratch pointers, in field order
SCRATCH = ("normed", "qkv", "qk_rotated", "attended", "attn_out", "gate_up", "activated")


class DecodeLayerWeights(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("input_norm", "post_attention_norm", "qkv", "qkv_bias",
                                          "o", "o_bias", "gate_up", "down")]


class DecodeModelShape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("num_q_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("block_size", ctypes.c_int),
                ("rms_norm_eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("gemm_kind", ctypes.c_int)]


class DecodeStepBuffers(ctypes.Structure):
    _fields_ = [("tokens", ctypes.c_int64), ("residual", _ptr), ("mlp_out", _ptr),
                ("cos_sin", _ptr), ("slots", _ptr), ("kv_cache", _ptr),
                ("num_slots", ctypes.c_int64), ("block_tables", _ptr), ("seq_lens", _ptr),
                ("max_blocks", ctypes.c_int64)] + [(name, _ptr) for name in SCRATCH] + [
                ("kv_scales", _ptr), ("kv_codes", ctypes.c_int), ("layer_windows", _ptr)]
