"""A pure decode step's decoder layers in one native call (CPU, bfloat16, weights packed for
our AMX or AVX-512 BF16 GEMM, a bf16 or an 8-bit KV pool).

`Decoder.forward` runs its layers one module at a time; on CPU that is ten native kernels
per layer, each opening an OpenMP region, with Python in between while the other threads wait
(a noticeable share of a decode step: bench/FIGURES.md).
`kernels/cpu/decode_step.c` runs the same kernels in the same order inside one region, so the
result is bit-identical; this module describes the weights to it once and the step's buffers
on every call. Anything it does not cover (prefill chunks, float32, Qwen3's q/k norm, families
other than Llama's (Gemma 3: other norms, activation and attention scale), weights not packed
for our kernels, more rows than the layers' GEMM kernel takes) returns None and the model runs
its layers as before.
PAGEDGEN_FUSED_DECODE=0 turns it off (for comparisons).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedgen.kernels.cpu import backend as cpu_backend
from pagedgen.kernels.cpu.decode_step_structs import (GEMM_KINDS, SCRATCH, DecodeLayerWeights,
                                                     DecodeModelShape, DecodeStepBuffers)
from pagedgen.model.config import LLAMA_STYLE
from pagedgen.model.layers.linear import MAX_ROWS

if TYPE_CHECKING:
    from torch import nn

    from pagedgen.model.config import ModelConfig
    from pagedgen.model.layers.attention import StepMetadata

def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


@dataclass(slots=True)
class FusedDecode:
    layers: ctypes.Array  # DecodeLayerWeights per layer; the tensors stay owned by the model
    row_widths: dict[str, int]  # scratch name -> elements per row
    gemm_kind: str  # the packing of every weight: "amx" or "avx512"
    # int32 [layers]: each layer's sliding window (0: full), or None: every layer attends with
    # the step plan's window. Per-layer windows need the plan's tables unshifted (window 0).
    layer_windows: torch.Tensor | None = None

    @classmethod
    def build(cls, config: ModelConfig, decoder_layers: nn.ModuleList,
              layer_windows: list[int] | None = None) -> FusedDecode | None:
        """The layer descriptions, or None when the model's layers are not all covered."""
        if not _covered(config) or os.environ.get("PAGEDGEN_FUSED_DECODE", "1") == "0":
            return None
        layers, kinds = [], set()
        for layer in decoder_layers:
            attention, mlp = layer.attention, layer.mlp
            packed = (attention.qkv_packed, attention.o_packed, mlp.gate_up_packed, mlp.down_packed)
            if any(p is None or p.kind not in GEMM_KINDS for p in packed):
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
        windows = None if layer_windows is None else torch.tensor(layer_windows, dtype=torch.int32)
        if windows is not None and windows.numel() != len(layers):
            raise ValueError(f"layer_windows has {windows.numel()} entries for "
                             f"{len(layers)} layers")
        return cls((DecodeLayerWeights * len(layers))(*layers), widths, kinds.pop(), windows)

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
        windows = self._windows(plan.sliding_window)
        if kv_codes is None or windows is None:
            return None
        decode = plan.decode
        scratch = self._scratch(tokens)
        shape = DecodeModelShape(config.hidden_size, config.intermediate_size, config.num_heads,
                            config.num_kv_heads, config.head_dim, kv_cache.shape[3],
                            config.rms_norm_eps, config.head_dim ** -0.5,
                            GEMM_KINDS[self.gemm_kind])
        buffers = DecodeStepBuffers(
            tokens, hidden.data_ptr(), scratch["mlp_out"].data_ptr(), step.rope.data_ptr(),
            step.slot_mapping.data_ptr(), kv_cache.data_ptr(), kv_cache.shape[2] * kv_cache.shape[3],
            decode.tables.data_ptr(), decode.lens.data_ptr(), decode.tables.shape[1],
            *(scratch[name].data_ptr() for name in SCRATCH),
            _address(step.kv_scales), kv_codes, windows.data_ptr())
        status = cpu_backend.decode_layers_bf16(
            ctypes.addressof(self.layers), len(self.layers), ctypes.byref(shape),
            ctypes.byref(buffers), torch.get_num_threads())
        if status == 2:
            raise MemoryError("native decode step: a thread could not allocate its scratch")
        return scratch["mlp_out"][:tokens] if status == 0 else None

    def _windows(self, plan_window: int) -> torch.Tensor | None:
        """Each layer's window for the C step, or None where the plan's tables do not fit
        them (a plan for one window holds tables shifted to it)."""
        if self.layer_windows is None:
            return torch.full((len(self.layers),), plan_window, dtype=torch.int32)
        if plan_window and bool((self.layer_windows != plan_window).any()):
            return None
        return self.layer_windows

    def _scratch(self, tokens: int) -> dict[str, torch.Tensor]:
        """Views of one allocation, each with whole 16-row blocks (the AMX GEMMs read them)."""
        rows = -(-tokens // 16) * 16
        flat = torch.empty(rows * sum(self.row_widths.values()), dtype=torch.bfloat16)
        views, offset = {}, 0
        for name, width in self.row_widths.items():
            views[name] = flat[offset:offset + rows * width].view(rows, width)
            offset += rows * width
        return views


def _covered(config: ModelConfig) -> bool:
    """The layers decode_step.c implements: Llama's norms, SiLU, head_dim ** -0.5."""
    return (not config.qk_norm and config.style == LLAMA_STYLE and config.hidden_act == "silu"
            and config.query_pre_attn_scalar is None)


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
