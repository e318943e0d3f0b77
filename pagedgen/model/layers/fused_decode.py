"""A pure decode step's decoder layers in one native call (CPU, bfloat16, weights packed for
our AMX or AVX-512 BF16 GEMM, a bf16 or an 8-bit KV pool).

`LlamaDecoder.forward` runs its layers one module at a time; on CPU that is ten native kernels
per layer, each opening an OpenMP region, with Python in between while the other threads wait
(a noticeable share of a decode step: bench/FIGURES.md).
`kernels/cpu_decode_step.c` runs the same kernels in the same order inside one region, so the
result is bit-identical; this module describes the weights to it once and the step's buffers
on every call. Anything it does not cover (prefill chunks, float32, Qwen3's q/k norm, weights
not packed for our kernels, more rows than the layers' GEMM kernel takes) returns None and the
model runs its layers as before.
PAGEDGEN_FUSED_DECODE=0 turns it off (for comparisons).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedgen.kernels import cpu_backend
from pagedgen.model.layers.linear import MAX_ROWS

if TYPE_CHECKING:
    from torch import nn

    from pagedgen.model.config import ModelConfig
    from pagedgen.model.layers.attention import StepMetadata

_ptr = ctypes.c_void_p


# The ctypes mirrors of kernels/cpu_decode_step.c's structs: same names, same fields, same order.
class DecodeLayerWeights(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("input_norm", "post_attention_norm", "qkv", "qkv_bias",
                                          "o", "o_bias", "gate_up", "down")]


class DecodeModelShape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("num_q_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("block_size", ctypes.c_int),
                ("rms_norm_eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("gemm_kind", ctypes.c_int)]


_GEMM_KINDS = {"amx": 0, "avx512": 1}  # cpu_decode_step.c's GEMM_AMX, GEMM_AVX512


_SCRATCH = ("normed", "qkv", "qk_rotated", "attended", "attn_out", "gate_up", "activated")


class DecodeStepBuffers(ctypes.Structure):
    _fields_ = [("tokens", ctypes.c_int64), ("residual", _ptr), ("mlp_out", _ptr),
                ("cos_sin", _ptr), ("slots", _ptr), ("kv_cache", _ptr),
                ("num_slots", ctypes.c_int64), ("block_tables", _ptr), ("seq_lens", _ptr),
                ("max_blocks", ctypes.c_int64)] + [(name, _ptr) for name in _SCRATCH] + [
                ("kv_scales", _ptr), ("kv_codes", ctypes.c_int)]


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


@dataclass(slots=True)
class FusedDecode:
    layers: ctypes.Array  # DecodeLayerWeights per layer; the tensors stay owned by the model
    row_widths: dict[str, int]  # scratch name -> elements per row
    gemm_kind: str  # the packing of every weight: "amx" or "avx512"

    @classmethod
    def build(cls, config: ModelConfig, decoder_layers: nn.ModuleList) -> FusedDecode | None:
        """The layer descriptions, or None when the model's layers are not all covered."""
        if config.qk_norm or os.environ.get("PAGEDGEN_FUSED_DECODE", "1") == "0":
            return None
        layers, kinds = [], set()
        for layer in decoder_layers:
            attention, mlp = layer.attention, layer.mlp
            packed = (attention.qkv_packed, attention.o_packed, mlp.gate_up_packed, mlp.down_packed)
            if any(p is None or p.kind not in _GEMM_KINDS for p in packed):
                return None
            kinds.update(p.kind for p in packed)
            layers.append(DecodeLayerWeights(
                _address(layer.input_norm.weight), _address(layer.post_attention_norm.weight),
                _address(packed[0].data), _address(attention.qkv_bias), _address(packed[1].data),
                _address(attention.o_bias), _address(packed[2].data), _address(packed[3].data)))
        q_size, kv_size = config.q_size, config.kv_size
        widths = {"normed": config.hidden_size, "qkv": q_size + 2 * kv_size,
                  "qk_rotated": q_size + kv_size, "attended": q_size,
                  "attn_out": config.hidden_size, "gate_up": 2 * config.intermediate_size,
                  "activated": config.intermediate_size, "mlp_out": config.hidden_size}
        if len(kinds) != 1:  # no layers, or (never seen) weights packed for different kernels
            return None
        return cls((DecodeLayerWeights * len(layers))(*layers), widths, kinds.pop())

    def run(self, config: ModelConfig, hidden: torch.Tensor, step: StepMetadata,
            kv_cache: torch.Tensor) -> torch.Tensor | None:
        """All layers over `hidden` (updated in place); returns the last layer's MLP output
        (still to be added to `hidden`), or None, untouched, when this step is not covered."""
        plan = step.plan
        tokens = hidden.shape[0]
        if (step.ops is not cpu_backend or plan is None or plan.prefills or plan.decode is None
                or tokens > MAX_ROWS[self.gemm_kind] or hidden.dtype != torch.bfloat16
                or not kv_cache.is_contiguous() or step.slot_mapping.dtype != torch.int64
                or not hidden.is_contiguous()):
            return None
        kv_codes = _pool_codes(kv_cache, step)
        if kv_codes is None:
            return None
        decode = plan.decode
        scratch = self._scratch(tokens)
        shape = DecodeModelShape(config.hidden_size, config.intermediate_size, config.num_heads,
                            config.num_kv_heads, config.head_dim, kv_cache.shape[3],
                            config.rms_norm_eps, config.head_dim ** -0.5,
                            _GEMM_KINDS[self.gemm_kind])
        buffers = DecodeStepBuffers(
            tokens, hidden.data_ptr(), scratch["mlp_out"].data_ptr(), step.rope.data_ptr(),
            step.slot_mapping.data_ptr(), kv_cache.data_ptr(), kv_cache.shape[2] * kv_cache.shape[3],
            decode.tables.data_ptr(), decode.lens.data_ptr(), decode.tables.shape[1],
            *(scratch[name].data_ptr() for name in _SCRATCH),
            _address(step.kv_scales), kv_codes)
        status = cpu_backend.decode_layers_bf16(
            ctypes.addressof(self.layers), len(self.layers), ctypes.byref(shape),
            ctypes.byref(buffers), torch.get_num_threads())
        if status == 2:
            raise MemoryError("native decode step: a thread could not allocate its scratch")
        return scratch["mlp_out"][:tokens] if status == 0 else None

    def _scratch(self, tokens: int) -> dict[str, torch.Tensor]:
        """Views of one allocation, each with whole 16-row blocks (the AMX GEMMs read them)."""
        rows = -(-tokens // 16) * 16
        flat = torch.empty(rows * sum(self.row_widths.values()), dtype=torch.bfloat16)
        views, offset = {}, 0
        for name, width in self.row_widths.items():
            views[name] = flat[offset:offset + rows * width].view(rows, width)
            offset += rows * width
        return views


def _pool_codes(kv_cache: torch.Tensor, step: StepMetadata) -> int | None:
    """0 for a bf16 pool, the C number of an 8-bit one, None where the step cannot run fused.
    An 8-bit store re-quantizes a token's whole block, so two rows of one step must never share
    a block (true of decode steps, which copy a shared last block before writing: checked)."""
    scales = step.kv_scales
    if scales is None:
        return 0 if kv_cache.dtype == torch.bfloat16 else None
    codes = cpu_backend.kv_code(kv_cache.dtype)
    if codes is None or scales.dtype != torch.float32 or not scales.is_contiguous():
        return None
    slots = step.slot_mapping
    blocks = slots // kv_cache.shape[3]
    if bool((slots < 0).any()) or torch.unique(blocks).numel() != blocks.numel():
        return None
    return codes
