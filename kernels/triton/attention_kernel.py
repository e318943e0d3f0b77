"""Triton paged attention over a mixed prefill + decode batch.

Grid: (sequence, kv head, query tile). One program owns BLOCK_Q query tokens of one
sequence and all GROUP query heads that share one kv head, packed as the BLOCK_M =
BLOCK_Q * GROUP_PAD rows of one tile: row r is token r // GROUP_PAD, head r % GROUP_PAD.
So K/V of a kv head are read once per tile for every query head that uses them (GQA), and
Q @ K^T is a single tl.dot. K/V are read straight from the paged cache through the block
table, TILE_N tokens (one or several whole blocks) per loop iteration, with an online
float32 softmax (flash attention). Decodes are tiles with one token: no split over the
context, which is fine for the batch sizes of offline generation. On a quantized pool
(kernels/kv_quant.py) K/V are loaded as 8-bit codes and scaled per block and kv head in
float32 right after the load, so the pool is read at one byte per element.
With a sliding window W > 0 a row at position p sees keys in (p - W, p]: a tile's loop starts
at the first key its first row sees, and nothing before it is loaded (a hybrid KV cache may
have given those blocks back to the pool).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,  # float32 [N, H_kv] of a quantized pool (unused otherwise)
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel uses exp2
    window,  # > 0: a row at position p sees keys in (p - window, p]; 0: keys 0..p
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_kt, stride_kh, stride_kd,  # k_cache and v_cache share strides
    stride_table,
    stride_scale_block,  # scales are [N, H_kv]; a kv head's scale is at + kv_head (stride 1)
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    TILE_N: tl.constexpr,  # keys per loop iteration, a multiple of BLOCK_SIZE
    COMPUTE_FP32: tl.constexpr,  # interpreter: bf16 arithmetic is wrong there, upcast
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no silent tf32 on the GPU
    QUANTIZED: tl.constexpr,  # K/V are 8-bit codes: value = code * scale[block, kv_head]
):
    seq, kv_head, q_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid is sized for the longest chunk
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    query_pos = seq_len - q_len + token  # rows past q_len see all keys: finite, not stored
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
                + dims[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if COMPUTE_FP32 or QUANTIZED:
        q = q.to(tl.float32)

    # Finite start: with a window a row may see none of a tile's keys (then p = 0, alpha = 1)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # Causal: the last row of this tile sees keys up to its own position, no further.
    kv_end = tl.minimum(seq_len, seq_len - q_len + (q_tile + 1) * BLOCK_Q)
    # Window: the first row of this tile sees nothing before kv_start, the later rows less.
    lowest = tl.where(window > 0, query_pos - window, -1)  # per row: keys > lowest
    kv_start = tl.where(window > 0,
                        tl.maximum(seq_len - q_len + q_tile * BLOCK_Q - window + 1, 0), 0)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    kv_offsets = kv_head.to(tl.int64) * stride_kh + dims[None, :] * stride_kd
    for start_n in range(kv_start, kv_end, TILE_N):
        key_pos = start_n + tl.arange(0, TILE_N)
        key_ok = key_pos < kv_end
        block_ids = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0)
        addr = (block_ids.to(tl.int64)[:, None] * stride_kb  # int64 before the stride
                + (key_pos % BLOCK_SIZE)[:, None] * stride_kt + kv_offsets)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + addr, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + addr, mask=kv_mask, other=0.0)
        if QUANTIZED:  # one scale per (block, kv head): a vector over the tile's keys
            scale_at = block_ids.to(tl.int64) * stride_scale_block + kv_head
            k = k.to(tl.float32) * tl.load(k_scale_ptr + scale_at, mask=key_ok, other=0.0)[:, None]
            v = v.to(tl.float32) * tl.load(v_scale_ptr + scale_at, mask=key_ok, other=0.0)[:, None]
        elif COMPUTE_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = ((key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > lowest[:, None])
                   & key_ok[None, :])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # l_i is 0 only on padded rows a window leaves without keys (not stored)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + token).to(tl.int64)
    tl.store(out_ptr + o_rows[:, None] * stride_ot + head[:, None] * stride_oh
             + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])
