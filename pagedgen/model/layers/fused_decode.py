"""A pure decode step's decoder layers in one native call (CPU, bfloat16, weights packed for
our AMX, AVX-512 BF16 or AVX2 GEMM or GGUF blocks as stored, a bf16 or an 8-bit KV pool, one
group or a hybrid one).

`Decoder.forward` runs its layers one module at a time; on CPU that is ten native kernels
per layer, each opening an OpenMP region, with Python in between while the other threads wait
(a noticeable share of a decode step: bench/FIGURES.md).
`kernels/cpu/decode_step.c` runs the same kernels in the same order inside one region, so the
result is bit-identical; this module describes the weights to it once and the step's buffers
on every call. It covers the Llama family and Gemma 3 (offset norms, sandwich norms, q/k
norms, GeGLU, query_pre_attn_scalar, a RoPE per layer kind, sliding layers on a hybrid pool
whose sliding groups released blocks). Anything it does not cover (prefill chunks, float32,
Qwen3's q/k norm, weights not packed for our kernels, more rows than the layers' GEMM kernel
takes: for GGUF blocks, the rows from which quantized_linear dequantizes) returns None and the
model runs its layers as before. On GGUF blocks each projection runs gguf_linear_team, the
kernels quantized_linear runs for the same rows, so there too the result is bit-identical.
PAGEDGEN_FUSED_DECODE=0 turns it off (for comparisons).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedgen.kernels.cpu import backend as cpu_backend
from pagedgen.kernels.cpu.gguf import team as gguf_team
from pagedgen.kernels.cpu.decode_step_structs import (ACTIVATIONS, GEMM_KINDS, NORM_STYLES,
                                                     SCRATCH, DecodeKVGroup, DecodeLayerWeights,
                                                     DecodeModelShape, DecodeStepBuffers)
from pagedgen.model.layers.linear import MAX_ROWS
from pagedgen.model.layers.quantized_linear import (QuantizedWeight, dequantize_min_rows,
                                                    tiles_min_rows)
from pagedgen.model.layers.rope import split_rope_rows

if TYPE_CHECKING:
    from torch import nn

    from pagedgen.model.config import ModelConfig
    from pagedgen.model.layers.attention import StepMetadata


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


@dataclass(slots=True)
class GgufScratch:
    """What the step needs for GGUF projections: gguf_linear_team's address, the projections'
    descriptions (their addresses are in the layers' table) and the shared scratch, kept
    between steps and grown to the largest step seen."""
    library: gguf_team.GgufLibrary
    linear_address: int  # gguf_linear_team in `library`
    projections: list[gguf_team.GgufProjection]
    widest_out: int  # the widest projection's output columns
    widest_in: int  # and the widest input
    out: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0))
    acts: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def buffers(self, tokens: int) -> tuple[int, int]:
        """(float32 output scratch, activation scratch) addresses for `tokens` rows."""
        if self.out.shape[0] < tokens:
            rows = -(-tokens // 16) * 16
            self.out = torch.empty(rows, self.widest_out, dtype=torch.float32)
            self.acts = torch.empty(gguf_team.scratch_bytes(self.library, rows, self.widest_in),
                                    dtype=torch.uint8)
        return self.out.data_ptr(), self.acts.data_ptr()


@dataclass(slots=True)
class FusedDecode:
    layers: ctypes.Array  # DecodeLayerWeights per layer; the tensors stay owned by the model
    row_widths: dict[str, int]  # scratch name -> elements per row
    gemm_kind: str  # the packing of every weight: "amx", "avx512", "avx2" or "gguf"
    max_rows: int  # the most rows (sequences) a step may have: the projections' kernel's limit
    # int32 [layers]: each layer's sliding window (0: full), or None: every layer attends with
    # the step plan's window. Per-layer windows need the plan's tables unshifted (window 0).
    layer_windows: torch.Tensor | None = None
    # int32 [layers]: which of the step's RoPE tables (split_rope_rows) each layer applies,
    # or None: all apply the one table
    layer_ropes: torch.Tensor | None = None
    # A hybrid pool's step.layer_slots and the int32 [layers, 2] copy handed to the C step
    # (the runner's layout: the same every step, so built once)
    _slots: tuple = ()
    _slots_table: torch.Tensor | None = None
    gguf: GgufScratch | None = None  # gemm_kind "gguf" only

    @classmethod
    def build(cls, config: ModelConfig, decoder_layers: nn.ModuleList,
              layer_windows: list[int] | None = None) -> FusedDecode | None:
        """The layer descriptions, or None when the model's layers are not all covered."""
        if not _covered(config) or os.environ.get("PAGEDGEN_FUSED_DECODE", "1") == "0":
            return None
        layers, kinds, projections = [], set(), []
        for layer in decoder_layers:
            described = _layer_weights(layer, projections)
            if described is None:
                return None
            layers.append(described[0])
            kinds.update(described[1])
        if len(kinds) != 1:  # no layers, or weights packed for different kernels
            return None
        kind = kinds.pop()
        gguf = _gguf_scratch(config, decoder_layers, projections) if kind == "gguf" else None
        if kind == "gguf" and gguf is None:
            return None
        windows = None if layer_windows is None else torch.tensor(layer_windows, dtype=torch.int32)
        if windows is not None and windows.numel() != len(layers):
            raise ValueError(f"layer_windows has {windows.numel()} entries for "
                             f"{len(layers)} layers")
        ropes = [layer.rope_index for layer in decoder_layers]
        max_rows = dequantize_min_rows(gguf.library) - 1 if gguf else MAX_ROWS[kind]
        return cls((DecodeLayerWeights * len(layers))(*layers), _row_widths(config), kind,
                   max_rows, windows,
                   torch.tensor(ropes, dtype=torch.int32) if any(ropes) else None, gguf=gguf)

    def run(self, config: ModelConfig, hidden: torch.Tensor, step: StepMetadata,
            kv_cache: torch.Tensor) -> torch.Tensor | None:
        """All layers over `hidden` (updated in place); returns the last layer's MLP output
        (still to be added to `hidden`), or None, untouched, when this step is not covered.
        A hybrid pool: each layer uses its group's step metadata (step.group_steps) and its
        position in kv_cache (step.layer_slots), as StepMetadata.for_layer gives the layers."""
        groups = step.group_steps or (step,)
        tokens = hidden.shape[0]
        if not self._takes(hidden, step, groups, kv_cache):
            return None
        kv_codes = _pool_codes(kv_cache, step.kv_scales, groups)
        plan_windows = {group.plan.sliding_window for group in groups}
        windows = self._windows(plan_windows.pop()) if len(plan_windows) == 1 else None
        ropes = split_rope_rows(step.rope)  # the tensors live until the call returns
        if kv_codes is None or windows is None or not all(
                rope.is_contiguous() and rope.shape == (tokens, 2, config.head_dim // 2)
                for rope in ropes):
            return None
        scratch = self._scratch(tokens)
        shape = _model_shape(config, kv_cache.shape[3], self.gemm_kind,
                             self.gguf.linear_address if self.gguf else None)
        gguf_buffers = self.gguf.buffers(tokens) if self.gguf else (None, None)
        rope_tables = (ctypes.c_void_p * len(ropes))(*(rope.data_ptr() for rope in ropes))
        kv_groups = (DecodeKVGroup * len(groups))(*(_kv_group(group) for group in groups))
        layer_slots = self._layer_slots(step.layer_slots)
        buffers = DecodeStepBuffers(
            tokens, hidden.data_ptr(), scratch["mlp_out"].data_ptr(),
            ctypes.addressof(rope_tables), _address(self.layer_ropes), len(ropes),
            kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.shape[2] * kv_cache.shape[3],
            ctypes.addressof(kv_groups), len(groups), _address(layer_slots),
            *(scratch[name].data_ptr() for name in SCRATCH),
            _address(step.kv_scales), kv_codes, windows.data_ptr(), *gguf_buffers)
        status = cpu_backend.decode_layers_bf16(
            ctypes.addressof(self.layers), len(self.layers), ctypes.byref(shape),
            ctypes.byref(buffers), torch.get_num_threads())
        if status == 2:
            raise MemoryError("native decode step: a thread could not allocate its scratch")
        return scratch["mlp_out"][:tokens] if status == 0 else None

    def _takes(self, hidden: torch.Tensor, step: StepMetadata, groups: tuple[StepMetadata, ...],
               kv_cache: torch.Tensor) -> bool:
        """The step's shape and metadata are the C step's: bf16 rows within the GEMM's limit,
        every group's step a pure decode on the native kernels, each layer placed."""
        return (hidden.shape[0] <= self.max_rows and hidden.dtype == torch.bfloat16
                and kv_cache.is_contiguous() and hidden.is_contiguous()
                and all(_pure_decode(group) for group in groups)
                and len(step.layer_slots) in (0, len(self.layers)))

    def _windows(self, plan_window: int) -> torch.Tensor | None:
        """Each layer's window for the C step, or None where the plan's tables do not fit
        them (a plan for one window holds tables shifted to it)."""
        if self.layer_windows is None:
            return torch.full((len(self.layers),), plan_window, dtype=torch.int32)
        if plan_window and bool((self.layer_windows != plan_window).any()):
            return None
        return self.layer_windows

    def _layer_slots(self, slots: tuple) -> torch.Tensor | None:
        """int32 [layers, 2] (group, position) of a hybrid pool, None for a one-group pool
        (layer l at position l)."""
        if not slots:
            return None
        if slots != self._slots:
            self._slots, self._slots_table = slots, torch.tensor(slots, dtype=torch.int32)
        return self._slots_table

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
    """The layers decode_step.c implements: either norm style (with Gemma's sandwich norms),
    SiLU or GELU tanh, any attention scale. q/k norms only in Gemma's style: the layer path
    runs Qwen3's (Llama style) in torch, whose float32 sum order the C does not reproduce."""
    style = config.style
    return (style.norm in NORM_STYLES and config.hidden_act in ACTIVATIONS
            and (not config.qk_norm or style.norm == "gemma"))


def _model_shape(config: ModelConfig, block_size: int, gemm_kind: str,
                 gguf_linear: int | None) -> DecodeModelShape:
    return DecodeModelShape(config.hidden_size, config.intermediate_size, config.num_heads,
                            config.num_kv_heads, config.head_dim, block_size,
                            config.rms_norm_eps, config.attention_scale, GEMM_KINDS[gemm_kind],
                            NORM_STYLES[config.style.norm], ACTIVATIONS[config.hidden_act],
                            gguf_linear)


def _row_widths(config: ModelConfig) -> dict[str, int]:
    """Elements per row of each scratch buffer; 0 for those the model's layers never use."""
    q_size, kv_size, hidden = config.q_size, config.kv_size, config.hidden_size
    return {"normed": hidden, "qkv": q_size + 2 * kv_size,
            "qk_normed": q_size + kv_size if config.qk_norm else 0,
            "qk_rotated": q_size + kv_size, "attended": q_size, "attn_out": hidden,
            "attn_normed": hidden if config.style.sandwich_norms else 0,
            "gate_up": 2 * config.intermediate_size, "activated": config.intermediate_size,
            "mlp_out": hidden}


def _layer_weights(layer: nn.Module, projections: list[gguf_team.GgufProjection]
                   ) -> tuple[DecodeLayerWeights, set[str]] | None:
    """One layer's description and its weights' packing kinds, or None where the C step
    cannot read them (a projection not packed for our GEMMs, a norm weight not bf16).
    GGUF projections are described into `projections`, which must outlive the table."""
    attention, mlp = layer.attention, layer.mlp
    packed = (attention.qkv_packed, attention.o_packed, mlp.gate_up_packed, mlp.down_packed)
    if any(p is None or p.kind not in GEMM_KINDS for p in packed):
        return None
    addresses = [_projection_address(p, projections) for p in packed]
    if None in addresses:
        return None
    norms = [None if norm is None else norm.weight for norm in (
        layer.input_norm, layer.post_attention_norm, layer.attention_out_norm,
        layer.mlp_out_norm)] + [attention.qk_norm_weight]
    if any(w is not None and (w.dtype != torch.bfloat16 or not w.is_contiguous())
           for w in norms):
        return None
    biases = (attention.qkv_bias, attention.o_bias)
    if any(b is not None and (b.dtype != torch.bfloat16 or not b.is_contiguous())
           for b in biases):
        return None
    weights = DecodeLayerWeights(
        *map(_address, norms), addresses[0], _address(biases[0]), addresses[1],
        _address(biases[1]), addresses[2], addresses[3])
    return weights, {p.kind for p in packed}


def _projection_address(packed, projections: list[gguf_team.GgufProjection]) -> int | None:
    """Where the C step reads a projection: our packing's data, or a GGUF projection's
    description (None where it cannot describe one, e.g. batch-invariant weights)."""
    if not isinstance(packed, QuantizedWeight):
        return packed.data.data_ptr()
    if packed.invariant:
        return None
    described = gguf_team.projection(
        [(part.tensor_type, part.blocks, part.row_map, part.out_features)
         for part in packed.parts], packed.in_features,
        tiles_min_rows(packed.library, (part.tensor_type for part in packed.parts)))
    if described is None:
        return None
    projections.append(described)
    return ctypes.addressof(described)


def _gguf_scratch(config: ModelConfig, decoder_layers: nn.ModuleList,
                  projections: list[gguf_team.GgufProjection]) -> GgufScratch | None:
    """The GGUF step's state, where every projection uses one kernel library."""
    libraries = {id(weight.library): weight.library for layer in decoder_layers
                 for weight in (layer.attention.qkv_packed, layer.attention.o_packed,
                                layer.mlp.gate_up_packed, layer.mlp.down_packed)}
    if len(libraries) != 1:
        return None
    widths, library = _row_widths(config), libraries.popitem()[1]
    return GgufScratch(library, gguf_team.linear_team_address(library), projections,
                       max(widths["qkv"], widths["gate_up"], config.hidden_size),
                       max(config.hidden_size, widths["attended"], widths["activated"]))


def _pure_decode(step: StepMetadata) -> bool:
    """A (group's) step the C step reads: native CPU kernels, one new token per sequence."""
    plan = step.plan
    return (step.ops is cpu_backend and plan is not None and not plan.prefills
            and plan.decode is not None and step.slot_mapping.dtype == torch.int64
            and step.slot_mapping.is_contiguous())


def _kv_group(step: StepMetadata) -> DecodeKVGroup:
    decode = step.plan.decode  # the unshifted (window 0) tables: the C skips released blocks
    return DecodeKVGroup(step.slot_mapping.data_ptr(), decode.tables.data_ptr(),
                         decode.lens.data_ptr(), decode.tables.shape[1])


def _pool_codes(kv_cache: torch.Tensor, scales: torch.Tensor | None,
                groups: tuple[StepMetadata, ...]) -> int | None:
    """0 for a bf16 pool, the C number of an 8-bit one, None where the step cannot run fused.
    An 8-bit store re-quantizes a token's whole block, so two rows of one step must never share
    a block of a group (true of decode steps, which copy a shared last block before writing:
    checked)."""
    if scales is None:
        return 0 if kv_cache.dtype == torch.bfloat16 else None
    codes = cpu_backend.kv_code(kv_cache.dtype)
    if codes is None or scales.dtype != torch.float32 or not scales.is_contiguous():
        return None
    for group in groups:
        slots = group.slot_mapping
        blocks = slots // kv_cache.shape[3]
        if bool((slots < 0).any()) or torch.unique(blocks).numel() != blocks.numel():
            return None
    return codes
