/* The AMX score path of decode_attention_bf16.c, included by it; empty where the build
 * has no AMX. Defines AMX_SCORES when present.
 *
 * Scores on the AMX tile unit: for 16 keys at a time, S^T[16 keys][16 columns] = K . Q^T, one
 * product per (kv head, 32 dims), with K's rows loaded straight from the cache as the left
 * tile and Q^T packed once per sequence as the right tile, its columns the query heads of that
 * kv head (the other columns zero). ~6 tile products for 16 keys x 9 heads against ~700 vector
 * instructions on the dot-product path. The scores come out key-major, 16 per key.
 */
#ifndef PAGEDGEN_CPU_DECODE_SCORES_AMX_H
#define PAGEDGEN_CPU_DECODE_SCORES_AMX_H

#include "decode_bf16_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "x86_common.h"

#define AMX_SCORES 1
#define TILE_WORDS 256 /* 16 rows x 16 pairs of bf16 */

/* Q^T tile (kv, i), row r, column h % 16 (h a query head of kv head `kv`): the pair
 * q[h][32 i + 2 r], q[h][32 i + 2 r + 1]. The other columns stay zero from the start. With
 * more than 16 heads (units' own keys, decode_shared_amx.h), heads 16-31 take the columns
 * again: their kv heads' products go to a second score tile. */
ALWAYS_INLINE void pack_query_tiles(const Bf16Job *job, const uint16_t *q, uint32_t *tiles,
                                    int DIM, int GROUP) {
    const int NV = DIM / 32;
    for (int kv = 0; kv < job->num_kv_heads; kv++)
        for (int i = 0; i < NV; i++) {
            uint32_t *tile = tiles + (kv * NV + i) * TILE_WORDS;
            for (int g = 0; g < GROUP; g++) {
                const int h = kv * GROUP + g;
                for (int r = 0; r < 16; r++)
                    memcpy(tile + r * 16 + h % 16, q + h * DIM + 32 * i + 2 * r, 4);
            }
        }
}

/* Tile 0: the scores; 1, 3: K rows; 2, 4: Q^T (two products in flight). */
#define SCORE_PRODUCT(A, B, P)                                                           \
    do {                                                                                 \
        _tile_loadd(A, chunk + ((P) / NV) * DIM + 32 * ((P) % NV), row_bytes);           \
        _tile_loadd(B, q_tiles + (P) * TILE_WORDS, 64);                                  \
        _tile_dpbf16ps(0, A, B);                                                         \
    } while (0)

/* Raw (unscaled) scores into scores[16 t + h] for all `len` keys (rows up to the next multiple
 * of 16 are written too: keys past len, ignored). Needs block_size % 16 == 0. */
ALWAYS_INLINE void score_keys_amx(const Bf16Job *job, const int64_t *table, int64_t len,
                                  const uint32_t *q_tiles, float *scores, NextPass then, int DIM) {
    const int bs = job->block_size, NV = DIM / 32, products = job->num_kv_heads * NV;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM, row_bytes = stride * 2;
    for (int64_t start = 0; start < len; start += bs) {
        const uint16_t *rows = block_rows(job, job->k_cache, table, start / bs, DIM);
        int count = len - start < bs ? (int)(len - start) : bs;
        Prefetch fetch = prefetch_ahead_start(job, job->k_cache, table, start, len, then, DIM);
        /* spread over the products (a burst stalls the tile loads behind it) */
        const int64_t share = (fetch.left / ((count + 15) / 16 * products) + 63) & ~(int64_t)63;
        for (int c = 0; c < count; c += 16) {
            const uint16_t *chunk = rows + (int64_t)c * stride;
            _tile_zero(0);
            int p = 0;
            for (; p + 1 < products; p += 2) {
                prefetch_some(&fetch, 2 * share);
                SCORE_PRODUCT(1, 2, p);
                SCORE_PRODUCT(3, 4, p + 1);
            }
            prefetch_some(&fetch, share);
            if (p < products) SCORE_PRODUCT(1, 2, p);
            _tile_stored(0, scores + (start + c) * 16, 64);
        }
    }
}

/* Key-major scores -> probabilities in place: scores[16 t + h] <- exp(scale (s - max_h)), with
 * 1 / sum_t in inv_sum[h] (16 lanes: one per column). */
ALWAYS_INLINE void softmax_columns(float *scores, int64_t len, float scale, float *inv_sum) {
    __m512 top = _mm512_set1_ps(-FLT_MAX), sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) top = _mm512_max_ps(top, _mm512_loadu_ps(scores + 16 * t));
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t t = 0; t < len; t++) {
        __m512 e = exp_nonpositive(
            _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + 16 * t), top), factor));
        _mm512_storeu_ps(scores + 16 * t, e);
        sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(inv_sum, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
}

#endif
#endif
