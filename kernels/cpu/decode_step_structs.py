"""ctypes mirrors of kernels/cpu/decode_step.c's structs: same names, same fields, same order
(tests/test_native_bindings.py and tests/test_fused_decode.py check them against the C). The
model side that fills them is pagedgen/model/layers/fused_decode.py."""
from __future__ import annotations

import ctypes

_ptr = ctypes.c_void_p

GEMM_KINDS = {"amx": 0, "avx512": 1, "gguf": 2, "avx2": 3}  # decode_step.c's GEMM_AMX, ..., _AVX2
NORM_STYLES = {"llama": 0, "gemma": 1}  # NORM_LLAMA, NORM_GEMMA (ArchitectureStyle.norm)
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # ACT_SILU, ACT_GELU_TANH (hidden_act)

# DecodeStepBuffers' scratch pointers, in field order
SCRATCH = ("normed", "qkv", "qk_normed", "qk_rotated", "attended", "attn_out", "attn_normed",
           "gate_up", "activated")


class DecodeLayerWeights(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in (
        "input_norm", "post_attention_norm", "attention_out_norm", "mlp_out_norm", "qk_norm",
        "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down")]


class DecodeModelShape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("num_q_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("block_size", ctypes.c_int),
                ("rms_norm_eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("gemm_kind", ctypes.c_int), ("norm_style", ctypes.c_int),
                ("activation", ctypes.c_int), ("gguf_linear", _ptr)]


class DecodeKVGroup(ctypes.Structure):
    _fields_ = [("slots", _ptr), ("block_tables", _ptr), ("seq_lens", _ptr),
                ("max_blocks", ctypes.c_int64)]


class DecodeStepBuffers(ctypes.Structure):
    _fields_ = [("tokens", ctypes.c_int64), ("residual", _ptr), ("mlp_out", _ptr),
                ("rope_tables", _ptr), ("layer_ropes", _ptr), ("num_ropes", ctypes.c_int),
                ("kv_cache", _ptr), ("kv_positions", ctypes.c_int64),
                ("num_slots", ctypes.c_int64), ("groups", _ptr), ("num_groups", ctypes.c_int),
                ("layer_slots", _ptr)] + [(name, _ptr) for name in SCRATCH] + [
                ("kv_scales", _ptr), ("kv_codes", ctypes.c_int), ("layer_windows", _ptr),
                ("gguf_out", _ptr), ("gguf_acts", _ptr)]
