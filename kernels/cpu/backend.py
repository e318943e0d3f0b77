"""Fast CPU paged-KV kernels: the C kernels where they apply, else block gather + SDPA.

Decodes: native.decode_attention reads K/V in place through the tables (float32 and bf16);
bf16 prefill chunks: native.prefill_attention (flash attention on AMX tiles, else with AVX-512
BF16, else with AVX2 FMAs, whichever the CPU has; all read K/V in place through the block
table); over an 8-bit pool
native.decode_attention_q8 and native.prefill_attention_q8 read the codes in place. Otherwise
index_select + SDPA(enable_gqa=True), which is fast, where repeat_interleave for GQA is far
slower (bench/FIGURES.md). All decodes go through one padded SDPA call; each prefill chunk gets
one call with a causal mask shifted by its cached context.
Computation stays in the input dtype (SDPA accumulates in float32 internally).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import native
from .attention_plan import AttentionPlan, PrefillChunk, plan_attention
from ..checks import (check_attention_args, check_copy_args, check_plan_fits, check_plan_window,
                      check_store_args)
from ..kv_quant import gather_dequantized, store_kv_quantized

# The model layers' other CPU fast paths come through here too, so that kernels/cpu/native.py stays
# private to this package. Each returns None where it does not apply (another device or dtype,
# a CPU without the instructions) and the caller runs plain torch.
from .native import (add_offset_rms_norm, add_rms_norm, amx_linear, argmax_rows,  # noqa: E402
                     avx2_linear, avx512_linear, gelu_tanh_mul, gemm_kind, gemm_pack, kv_code, rope, silu_mul)

__all__ = ["AttentionPlan", "add_offset_rms_norm", "add_rms_norm", "amx_linear", "argmax_rows",
           "avx2_linear", "avx512_linear", "copy_blocks", "decode_layers_bf16", "gelu_tanh_mul", "gemm_kind",
           "gemm_pack", "kv_code", "paged_attention", "plan_attention", "rope", "silu_mul",
           "store_kv"]


def decode_layers_bf16(layers: int, num_layers: int, shape: object, buffers: object, threads: int) -> int:
    """All decoder layers of a pure bf16 decode step (bf16 or 8-bit pool) in one native call
    (kernels/cpu/decode_step.c, structs mirrored in pagedgen/model/layers/fused_decode.py):
    0 done, 1 not covered, 2 no memory."""
    return native.load().decode_layers_bf16(layers, num_layers, shape, buffers, threads)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Write K/V of token t into slot slot_mapping[t]; slot -1 skips the token.

    With k_scales/v_scales ([N, H_kv] float32), the caches hold 8-bit codes (kv_quant.py).
    """
    check_store_args(key, value, k_cache, v_cache, slot_mapping)
    if k_scales is not None:
        store_kv_quantized(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)
        return
    if native.store_kv(key, value, k_cache, v_cache, slot_mapping):
        return
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if slots.numel() and int(slots.max()) >= capacity:  # checked first: write all or nothing
        raise ValueError(f"slot_mapping has a slot past the cache's {capacity} slots")
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slots, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(v_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    plan: AttentionPlan | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Causal paged attention over a flat batch (docs/contracts.md §2).

    Pass `plan` (from plan_attention with the same metadata and window) to skip rebuilding
    the gather indices and masks; the runner builds it once per step for all layers.
    With k_scales/v_scales the caches are quantized: blocks are dequantized as gathered.
    sliding_window W > 0: a query at position p sees keys in (p - W, p]; blocks wholly
    before every query's window are not read.
    """
    check_attention_args(query, k_cache, v_cache)
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1],
                              sliding_window)
    check_plan_fits(plan.block_size, plan.num_tokens, query, k_cache)
    check_plan_window(plan.sliding_window, sliding_window)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
    if k_scales is not None:
        _attend_quantized(query, QuantizedKV(k_cache, v_cache, k_scales, v_scales), plan,
                          scale, out)
        return out
    if plan.decode is not None:
        _attend_decodes(query, k_cache, v_cache, plan, scale, out)
    for chunk in plan.prefills:
        rows = out[chunk.begin:chunk.end]
        # AMX, else AVX-512 BF16 flash attention where the CPU has it (bf16); SDPA over gathered
        # blocks otherwise.
        if not native.prefill_attention(query[chunk.begin:chunk.end], k_cache, v_cache,
                                        chunk.blocks, chunk.context_len, scale, rows,
                                        plan.sliding_window):
            rows.copy_(_attend_prefill(query, k_cache, v_cache, chunk, plan, scale))
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int, out: torch.Tensor):
    """[num_seqs, H_kv, nb * B, D] view of the listed blocks (SDPA's head-major layout)."""
    # index_select over a 2-D [N, B*H*D] view copies whole contiguous rows, unlike over 4-D.
    torch.index_select(cache.reshape(cache.shape[0], -1), 0, blocks, out=out)
    return out.view(num_seqs, -1, *cache.shape[2:]).transpose(1, 2)


def _gather_kv(k_cache, v_cache, blocks, num_seqs, plan: AttentionPlan):
    shape = (blocks.numel(), k_cache[0].numel())
    k = _gather(k_cache, blocks, num_seqs, plan.buffer("k", shape, k_cache))
    v = _gather(v_cache, blocks, num_seqs, plan.buffer("v", shape, v_cache))
    return k, v


def _attend_decodes(query, k_cache, v_cache, plan: AttentionPlan, scale, out) -> None:
    group = plan.decode
    whole = not plan.prefills  # a pure decode step: its rows are 0..S-1, in order
    q = query if whole else query.index_select(0, group.rows)  # [S_d, H_q, D], rows may be strided
    attended = out if whole else plan.buffer("decode_out", tuple(q.shape), q)
    # The native kernel reads K/V in place through the tables: no gathered copy to write and read.
    if native.decode_attention(q, k_cache, v_cache, group.tables, group.lens, scale, attended,
                               plan.sliding_window):
        if not whole:
            out.index_copy_(0, group.rows, attended)
        return
    q = q.unsqueeze(2)  # [S_d, H_q, 1, D]
    k, v = _gather_kv(k_cache, v_cache, group.blocks, group.rows.numel(), plan)
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale,
                                              enable_gqa=True)
    out.index_copy_(0, group.rows, attended.squeeze(2))


def _attend_prefill(query, k_cache, v_cache, chunk: PrefillChunk, plan, scale) -> torch.Tensor:
    q = query[chunk.begin:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H_q, q_len, D]
    k, v = _gather_kv(k_cache, v_cache, chunk.blocks, 1, plan)
    return _sdpa_prefill(q, k, v, chunk, scale)


def _sdpa_prefill(q, k, v, chunk: PrefillChunk, scale) -> torch.Tensor:
    """q [1, H_q, q_len, D] against gathered k/v [1, H_kv, nb * B, D] -> [q_len, H_q, D]."""
    if chunk.mask is None:  # no cached context: keys == queries, the plain causal case
        k, v = k[:, :, :chunk.context_len], v[:, :, :chunk.context_len]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=True)
    else:
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale,
                                                  enable_gqa=True)
    return attended.squeeze(0).transpose(0, 1)


@dataclass(slots=True)
class QuantizedKV:
    """One layer's quantized caches: codes [N, B, H_kv, D] and scales [N, H_kv]."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scales: torch.Tensor
    v_scales: torch.Tensor

    def gather(self, blocks: torch.Tensor, num_seqs: int, dtype: torch.dtype):
        """K and V of the listed blocks, dequantized to `dtype`, as [S, H_kv, nb * B, D]."""
        def one(cache, scales):
            values = gather_dequantized(cache, scales, blocks, dtype)
            return values.view(num_seqs, -1, *cache.shape[2:]).transpose(1, 2)
        return one(self.k_cache, self.k_scales), one(self.v_cache, self.v_scales)


def _attend_quantized(query, kv: QuantizedKV, plan: AttentionPlan, scale, out) -> None:
    """The native kernels read the codes in place (decodes: half the bytes of bf16; prefill
    chunks: no dequantized copy of the context); else gather + dequantize + SDPA."""
    group = plan.decode
    if group is not None and not _attend_decodes_native(query, kv, plan, scale, out):
        q = query.index_select(0, group.rows).unsqueeze(2)  # [S_d, H_q, 1, D]
        k, v = kv.gather(group.blocks, group.rows.numel(), query.dtype)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale,
                                                  enable_gqa=True)
        out.index_copy_(0, group.rows, attended.squeeze(2))
    for chunk in plan.prefills:
        if native.prefill_attention_q8(query[chunk.begin:chunk.end], kv.k_cache, kv.v_cache,
                                       kv.k_scales, kv.v_scales, chunk.blocks, chunk.context_len,
                                       scale, out[chunk.begin:chunk.end], plan.sliding_window):
            continue
        q = query[chunk.begin:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H_q, q_len, D]
        k, v = kv.gather(chunk.blocks, 1, query.dtype)
        out[chunk.begin:chunk.end] = _sdpa_prefill(q, k, v, chunk, scale)


def _attend_decodes_native(query, kv: QuantizedKV, plan: AttentionPlan, scale, out) -> bool:
    group = plan.decode
    whole = not plan.prefills  # a pure decode step: its rows are 0..S-1, in order
    q = query if whole else query.index_select(0, group.rows)
    attended = out if whole else plan.buffer("decode_out", tuple(q.shape), q)
    if not native.decode_attention_q8(q, kv.k_cache, kv.v_cache, kv.k_scales, kv.v_scales,
                                      group.tables, group.lens, scale, attended,
                                      plan.sliding_window):
        return False
    if not whole:
        out.index_copy_(0, group.rows, attended)
    return True


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every layer's K and V of block src[i] into block dst[i] (copy-on-write)."""
    check_copy_args(kv_cache, src, dst)
    if src.numel() == 0:
        return
    if kv_cache.dtype.itemsize == 1:  # 8-bit codes: a byte copy (no float8 index_copy_ on CPU)
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache.index_copy_(2, dst.long(), kv_cache.index_select(2, src.long()))
