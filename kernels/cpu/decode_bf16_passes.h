/* The passes of the bf16 decode-attention kernel over one sequence's blocks (decode_attention_bf16.c
 * describes the design), shared by its per-sequence path and by units of sequences that share
 * blocks (decode_shared_blocks.h): scores of a query against a range of keys, the softmax,
 * the weighted sum of values, and the per-thread scratch they work in. Needs AVX-512
 * F/BW/BF16; empty on other builds. */
#ifndef PAGEDGEN_CPU_DECODE_BF16_PASSES_H
#define PAGEDGEN_CPU_DECODE_BF16_PASSES_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "decode_bf16_blocks.h"
#include "x86_common.h"

#define CHUNK 16 /* scores summed per transpose-add tree: one per float32 lane */
#define MAX_GROUP 8 /* query heads per kv head (specialisations below) */
#define MAX_VECS 16 /* float32 vectors per head row: head_dim 256 */

/* Lane t: q . row t, for the first n of 16 rows `stride` elements apart (lanes >= n: 0). */
ALWAYS_INLINE __m512 dot_chunk(const uint16_t *rows, int n, int64_t stride, const uint16_t *q,
                               int NV) {
    __m512 dots[CHUNK];
    for (int t = 0; t < CHUNK; t++) {
        __m512 acc = _mm512_setzero_ps();
        if (t < n)
            for (int i = 0; i < NV; i++)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + 32 * i),
                                       (__m512bh)_mm512_loadu_si512(rows + t * stride + 32 * i));
        dots[t] = acc;
    }
    return sum16(dots);
}

/* Scaled scores of every query head against keys [from, len) (from: a block's first key) into
 * scores[h * len + t], and each head's maximum over the keys from `first` on folded into
 * max_score[h]. Block by block, all kv heads of a block before the next, so the block's bytes
 * are read once, front to back. */
ALWAYS_INLINE void score_keys(const Bf16Job *job, const int64_t *table, int64_t from, int64_t len,
                              int64_t first, const uint16_t *q, float *scores, float *max_score,
                              NextPass then, int DIM, int GROUP) {
    const int bs = job->block_size, NV = DIM / 32, heads = job->num_q_heads;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM; /* elements between tokens */
    const __m512 scale = _mm512_set1_ps(job->scale);
    for (int64_t start = from; start < len; start += bs) {
        const uint16_t *rows = block_rows(job, job->k_cache, table, start / bs, DIM);
        int count = len - start < bs ? (int)(len - start) : bs;
        Prefetch fetch = prefetch_ahead_start(job, job->k_cache, table, start, len, then, DIM);
        const int64_t share = (fetch.left / heads + 63) & ~(int64_t)63;
        for (int c = 0; c < count; c += CHUNK) {
            int n = count - c < CHUNK ? count - c : CHUNK;
            __mmask16 valid = (__mmask16)((1u << n) - 1u);
            const __mmask16 seen = valid & ~keys_before(start + c, first);
            for (int h = 0; h < heads; h++) {
                prefetch_some(&fetch, share);
                const uint16_t *chunk = rows + (int64_t)c * stride + (h / GROUP) * DIM;
                /* Two copies of the loop so that the full chunks (nearly all) have no branch. */
                __m512 s = n == CHUNK ? dot_chunk(chunk, CHUNK, stride, q + h * DIM, NV)
                                      : dot_chunk(chunk, n, stride, q + h * DIM, NV);
                s = _mm512_mul_ps(s, scale);
                _mm512_mask_storeu_ps(scores + h * len + start + c, valid, s);
                if (seen)
                    max_score[h] = fmaxf(max_score[h], _mm512_mask_reduce_max_ps(seen, s));
            }
        }
    }
}

/* scores[h] <- exp(scores[h] - max), 0 before key `first`; returns 1 / sum per head in
 * inv_sum[h]. */
ALWAYS_INLINE void softmax_rows(float *scores, int64_t len, int64_t first, const float *max_score,
                                float *inv_sum, int heads) {
    for (int h = 0; h < heads; h++) {
        float *row = scores + h * len;
        __m512 top = _mm512_set1_ps(max_score[h]), sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += CHUNK) {
            __mmask16 valid = len - t >= CHUNK ? 0xffff : (__mmask16)((1u << (len - t)) - 1u);
            const __mmask16 seen = valid & ~keys_before(t, first);
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(seen, row + t), top));
            e = _mm512_maskz_mov_ps(seen, e);
            _mm512_mask_storeu_ps(row + t, valid, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv_sum[h] = 1.0f / _mm512_reduce_add_ps(sum);
    }
}

/* Where p[h][t] is in the probabilities: probs[h * head + t * token]. */
typedef struct {
    int64_t head, token;
} ProbLayout;

/* acc[g] += sum over the block's `count` tokens of p[g][t] * V[t] for one kv head's GROUP
 * query heads; the accumulators live in registers for the block. V[t] from the bf16 rows, or
 * (converted != NULL) already widened to float32 there, [count][DIM]: the same values. */
ALWAYS_INLINE void weigh_block(const uint16_t *rows, const float *converted, int count,
                               int64_t stride, const float *probs, ProbLayout layout, float *acc,
                               Prefetch *fetch, int64_t share, int DIM, int GROUP) {
    const int NF = DIM / 16;
    __m512 sum[MAX_GROUP][MAX_VECS];
    for (int g = 0; g < GROUP; g++)
        for (int j = 0; j < NF; j++) sum[g][j] = _mm512_loadu_ps(acc + g * DIM + 16 * j);
    for (int t = 0; t < count; t++) {
        prefetch_some(fetch, share);
        __m512 value[MAX_VECS];
        for (int j = 0; j < NF; j++)
            value[j] = converted ? _mm512_loadu_ps(converted + t * DIM + 16 * j)
                                 : bf16x16_to_f32(rows + t * stride + 16 * j);
        for (int g = 0; g < GROUP; g++) {
            __m512 p = _mm512_set1_ps(probs[g * layout.head + t * layout.token]);
            for (int j = 0; j < NF; j++) sum[g][j] = _mm512_fmadd_ps(p, value[j], sum[g][j]);
        }
    }
    for (int g = 0; g < GROUP; g++)
        for (int j = 0; j < NF; j++) _mm512_storeu_ps(acc + g * DIM + 16 * j, sum[g][j]);
}

ALWAYS_INLINE void zero_floats(float *acc, int64_t count) { /* count: a multiple of 16 */
    for (int64_t i = 0; i < count; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
}

/* out rows of every query head = acc[h] / sum[h], rounded to bf16. */
ALWAYS_INLINE void write_output(const float *acc, const float *inv_sum, uint16_t *out, int heads,
                                int DIM) {
    for (int h = 0; h < heads; h++) {
        __m512 inv = _mm512_set1_ps(inv_sum[h]);
        for (int j = 0; j < DIM / 16; j++)
            _mm256_storeu_si256((__m256i *)(out + h * DIM + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_loadu_ps(acc + h * DIM + 16 * j), inv)));
    }
}

/* acc[h] += sum over keys t in [from, len) (from: a block's first key) of p[h][t] * V[t]; block
 * by block, all kv heads of a block before the next. acc: num_q_heads * DIM floats. */
ALWAYS_INLINE void weigh_values(const Bf16Job *job, const int64_t *table, int64_t from,
                                int64_t len, const float *probs, ProbLayout layout, float *acc,
                                NextPass then, int DIM, int GROUP) {
    const int bs = job->block_size;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM;
    for (int64_t start = from; start < len; start += bs) {
        const uint16_t *rows = block_rows(job, job->v_cache, table, start / bs, DIM);
        int count = len - start < bs ? (int)(len - start) : bs;
        Prefetch fetch = prefetch_ahead_start(job, job->v_cache, table, start, len, then, DIM);
        const int64_t share = (fetch.left / (count * job->num_kv_heads) + 63) & ~(int64_t)63;
        for (int kv = 0; kv < job->num_kv_heads; kv++)
            weigh_block(rows + kv * DIM, NULL, count, stride,
                        probs + kv * GROUP * layout.head + start * layout.token, layout,
                        acc + kv * GROUP * DIM, &fetch, share, DIM, GROUP);
    }
}

/* Per-thread scratch: scores, per-head max and 1/sum (16 at least), V sums, each once per
 * member of a unit of sequences that share blocks (member m's at m times its size); with AMX,
 * Q^T and the units' tiles. */
typedef struct {
    float *scores, *max_score, *inv_sum, *acc;
    uint32_t *q_tiles;    /* NULL: the dot-product path */
    uint32_t *unit_queries; /* a unit's queries in lanes (decode_shared_blocks.h) */
    float *unit_values;     /* one shared block's V rows of one kv head, widened */
    uint32_t *value_tiles;  /* NULL: units' vector passes; else their tiles (decode_shared_amx.h) */
    uint16_t *prob_tiles;
    float *tile_out;
    uint32_t *own_q_tiles;  /* a member's Q^T for its own keys (decode_shared_amx.h) */
    int64_t score_floats; /* one member's scores */
    int lanes, head_dim;  /* one member's max_score and inv_sum floats; its acc: heads x head_dim */
} Scratch;

#endif
#endif
