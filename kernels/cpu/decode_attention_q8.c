/* Paged decode attention over an 8-bit KV pool with AVX-512: the fast path that
 * decode_attention.c tries first for int8 / fp8 codes (its portable loop serves the rest).
 *
 * The portable loop is bound by instructions, not bytes: each row is decoded through a stack
 * buffer and each q.k dot ends in a horizontal sum. Here
 *   - int8 keys against bf16 queries, with AVX-512 VNNI: the query row is quantized on the fly
 *     to int16 (one scale per head, finer than its bf16 input) split in two int8 halves, the
 *     key codes are offset to unsigned (x ^ 0x80 = x + 128, a constant correction per head), and
 *     q.k is two VPDPBUSD per 64 codes: exact integer dots, one float multiply per score;
 *   - otherwise 16 codes become 16 float32 lanes in registers: int8 by sign extension and
 *     conversion; e5m2 is the high byte of a float16 (shift, then VCVTPH2PS); e4m3 is the
 *     sign-extended byte shifted into a float16 of 1/256 of its value (the 256 joins the
 *     block's scale). Subnormal codes convert exactly: VCVTPH2PS does not flush them;
 *   - the scores of 16 keys against one query head are summed at once by a transpose-add tree
 *     (sum16), and the block's K scale multiplies the 16 sums;
 *   - each pass walks a sequence's blocks once, all kv heads of a block before the next, so
 *     every block is read front to back, once (a pass per kv head touched a third of each
 *     cache line run and left the hardware prefetchers nothing to follow);
 *   - blocks are scattered, so the block AHEAD blocks on (the K pass's last ones hand on to the
 *     V pass's first) is prefetched into L2 a line at a time spread over the computation,
 *     as the bf16 kernel does; 8-bit blocks are half as long, hence two blocks ahead;
 *   - the V pass keeps one kv head's query-head accumulators in registers over a block and
 *     folds the V scale into each softmax weight.
 * Block sizes must be multiples of 16: a 16-key chunk never crosses a block, and keys past
 * seq_len inside the last block are real slots (read, then masked).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team_ops.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>

#include "kv_codes.h"
#include "x86_common.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_GROUP 8
#define MAX_VECS 16 /* float32 vectors per head row: head_dim 256 */
#define AHEAD 2    /* blocks prefetched ahead */
#define Q16_MAX 32639 /* largest |q| in int16 steps whose two int8 halves stay in range */

/* Per-thread scratch (one allocation). */
typedef struct {
    float *scores;     /* num_q_heads rows of `padded` */
    float *q;          /* num_q_heads x D: scaled float32 queries (float path) */
    int8_t *q_hi, *q_lo; /* num_q_heads x D: int16 queries in two halves (VNNI path) */
    float *q_step;     /* per head: the int16 step (VNNI path) */
    int32_t *q_offset; /* per head: 128 x sum of the int16 query (VNNI path) */
    float *acc, *top, *denom;
} Scratch;

/* A block's worth of lines to prefetch into L2, a few at a time. */
typedef struct {
    const char *next;
    int64_t left;
} Prefetch;

ALWAYS_INLINE void prefetch_some(Prefetch *fetch, int64_t bytes) {
    for (; fetch->left > 0 && bytes > 0; bytes -= 64, fetch->left -= 64, fetch->next += 64)
        _mm_prefetch(fetch->next, _MM_HINT_T1);
}

/* The block AHEAD blocks past block b of the K (v_pass 0) or V pass; K runs on into V. */
ALWAYS_INLINE Prefetch block_ahead(const DecodeAttention *a, const int64_t *table,
                                   int64_t blocks, int v_pass, int64_t b, int64_t block_bytes) {
    Prefetch fetch = {NULL, 0};
    int64_t target = b + AHEAD;
    const uint8_t *cache = v_pass ? a->v_cache : a->k_cache;
    if (target >= blocks) {
        if (v_pass) return fetch;
        target -= blocks;
        cache = a->v_cache;
        if (target >= blocks) return fetch;
    }
    fetch.next = (const char *)cache + table[target] * block_bytes;
    fetch.left = block_bytes;
    return fetch;
}

ALWAYS_INLINE __m512 load_query(const DecodeAttention *a, int64_t row, int v) {
    if (a->is_bf16) {
        return bf16x16_to_f32((const uint16_t *)a->q + row + 16 * v);
    }
    return _mm512_loadu_ps((const float *)a->q + row + 16 * v);
}

/* float32 -> bfloat16, round to nearest even (the portable kernel's rounding). */
ALWAYS_INLINE __m256i to_bf16(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

ALWAYS_INLINE void store_out(const DecodeAttention *a, int64_t row, int v, __m512 x) {
    if (a->is_bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)a->out + row + 16 * v), to_bf16(x));
    else
        _mm512_storeu_ps((float *)a->out + row + 16 * v, x);
}

/* The sequence's query rows, times the softmax scale: float32 for the float path; for VNNI,
 * round(q / step) with step = max |q| / Q16_MAX per head, as hi * 256 + lo (both int8). */
ALWAYS_INLINE void prepare_queries(const DecodeAttention *a, int seq, const Scratch *s, int DIM,
                                   int vnni) {
    const int V = DIM / 16;
    for (int h = 0; h < a->num_q_heads; h++) {
        const int64_t row = (int64_t)seq * a->q_stride + (int64_t)h * DIM;
        __m512 x[MAX_VECS], top = _mm512_setzero_ps();
        for (int v = 0; v < V; v++) {
            x[v] = _mm512_mul_ps(load_query(a, row, v), _mm512_set1_ps(a->scale));
            _mm512_storeu_ps(s->q + h * DIM + 16 * v, x[v]);
            top = _mm512_max_ps(top, _mm512_abs_ps(x[v]));
        }
        if (!vnni) continue;
        const float largest = _mm512_reduce_max_ps(top);
        const float step = largest > 0 ? largest / Q16_MAX : 1.0f;
        __m512i total = _mm512_setzero_si512();
        for (int v = 0; v < V; v++) {
            __m512i q16 = _mm512_cvtps_epi32(_mm512_mul_ps(x[v], _mm512_set1_ps(1.0f / step)));
            q16 = _mm512_max_epi32(_mm512_min_epi32(q16, _mm512_set1_epi32(Q16_MAX)),
                                   _mm512_set1_epi32(-Q16_MAX));
            __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q16, _mm512_set1_epi32(128)), 8);
            __m512i lo = _mm512_sub_epi32(q16, _mm512_slli_epi32(hi, 8));
            _mm_storeu_si128((__m128i *)(s->q_hi + h * DIM + 16 * v), _mm512_cvtepi32_epi8(hi));
            _mm_storeu_si128((__m128i *)(s->q_lo + h * DIM + 16 * v), _mm512_cvtepi32_epi8(lo));
            total = _mm512_add_epi32(total, q16);
        }
        s->q_step[h] = step;
        s->q_offset[h] = 128 * _mm512_reduce_add_epi32(total);
    }
}

#if defined(__AVX512VNNI__)
#define HAVE_VNNI 1
/* Integer dots of 16 int8 key rows (stride apart) with query head h: lane t = sum over the row
 * of (k + 128) * q16 (the +128 is taken off by the caller). */
ALWAYS_INLINE __m512i dots_vnni(const uint8_t *rows, int64_t stride, const Scratch *s, int h,
                                int DIM) {
    const int W = DIM / 64;
    __m512i hi[2], lo[2], dots[16];
    for (int w = 0; w < W; w++) {
        hi[w] = _mm512_loadu_si512(s->q_hi + h * DIM + 64 * w);
        lo[w] = _mm512_loadu_si512(s->q_lo + h * DIM + 64 * w);
    }
    for (int t = 0; t < 16; t++) {
        __m512i acc = _mm512_setzero_si512(), k[2];
        for (int w = 0; w < W; w++)
            k[w] = _mm512_xor_si512(_mm512_loadu_si512(rows + t * stride + 64 * w),
                                    _mm512_set1_epi8((char)0x80));
        for (int w = 0; w < W; w++) acc = _mm512_dpbusd_epi32(acc, k[w], hi[w]);
        acc = _mm512_slli_epi32(acc, 8);
        for (int w = 0; w < W; w++) acc = _mm512_dpbusd_epi32(acc, k[w], lo[w]);
        dots[t] = acc;
    }
    return sum16_epi32(dots);
}
#else
#define HAVE_VNNI 0
#endif

/* Scores of the 16 keys at `rows` against the GROUP query heads from `head`, in float, times
 * the block's K scale; each head's maximum over the valid lanes into top[]. */
ALWAYS_INLINE void score_chunk(const uint8_t *rows, int64_t stride, const Scratch *s, int head,
                               float k_scale, float *dst, int64_t padded, __mmask16 valid,
                               int DIM, int GROUP, int codes, int vnni) {
    const int V = DIM / 16;
#if HAVE_VNNI
    if (vnni) {
        for (int g = 0; g < GROUP; g++) {
            const int h = head + g;
            __m512i dot = _mm512_sub_epi32(dots_vnni(rows, stride, s, h, DIM),
                                           _mm512_set1_epi32(s->q_offset[h]));
            __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(s->q_step[h] * k_scale));
            _mm512_storeu_ps(dst + h * padded, x);
            if (valid) s->top[h] = fmaxf(s->top[h], _mm512_mask_reduce_max_ps(valid, x));
        }
        return;
    }
#endif
    __m512 dots[MAX_GROUP][16];
    for (int t = 0; t < 16; t++) {
        __m512 k[MAX_VECS];
        for (int v = 0; v < V; v++) k[v] = decode16(rows + t * stride + 16 * v, codes);
        for (int g = 0; g < GROUP; g++) {
            const float *q = s->q + (head + g) * DIM;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
            for (int v = 1; v < V; v++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * v), k[v], acc);
            dots[g][t] = acc;
        }
    }
    for (int g = 0; g < GROUP; g++) {
        __m512 x = _mm512_mul_ps(sum16(dots[g]), _mm512_set1_ps(k_scale));
        _mm512_storeu_ps(dst + (head + g) * padded, x);
        if (valid)
            s->top[head + g] = fmaxf(s->top[head + g], _mm512_mask_reduce_max_ps(valid, x));
    }
}

/* Scores of every query head against the len keys into scores[h * padded + t] (rows padded to
 * whole chunks of 16; no infinities: -ffast-math), block by block, all kv heads of a block
 * before the next; keys before `first` (a sliding window's) are left out of the maxima. */
ALWAYS_INLINE void score_keys(const DecodeAttention *a, const int64_t *table, int64_t len,
                              int64_t first,
                              const Scratch *s, int64_t padded, int DIM, int GROUP, int codes,
                              int vnni) {
    const int hkv = a->num_kv_heads, bs = a->block_size;
    const int64_t stride = (int64_t)hkv * DIM, block_bytes = bs * stride;
    const int64_t blocks = (len + bs - 1) / bs;
    for (int h = 0; h < a->num_q_heads; h++) s->top[h] = -FLT_MAX;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t block = table[b], start = b * bs;
        const uint8_t *rows = (const uint8_t *)a->k_cache + block * block_bytes;
        const int64_t keys = padded - start < bs ? padded - start : bs;
        Prefetch fetch = block_ahead(a, table, blocks, 0, b, block_bytes);
        const int64_t share = (block_bytes / (hkv * (keys / 16)) + 63) & ~(int64_t)63;
        for (int kv = 0; kv < hkv; kv++) {
            const float k_scale = a->k_scales[block * hkv + kv] * code_factor(codes);
            for (int64_t c = 0; c < keys; c += 16) {
                prefetch_some(&fetch, share);
                const int64_t left = len - start - c;
                __mmask16 valid = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
                valid &= ~keys_before(start + c, first);
                score_chunk(rows + c * stride + kv * DIM, stride, s, kv * GROUP, k_scale,
                            s->scores + start + c, padded, valid, DIM, GROUP, codes, vnni);
            }
        }
    }
}

/* exp(score - top) in place for the keys first..len-1 (the padding and the keys before `first`
 * get 0); returns their sum. */
ALWAYS_INLINE float softmax_row(float *row, int64_t len, int64_t first, float top) {
    __m512 sum = _mm512_setzero_ps(), m = _mm512_set1_ps(top);
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 live = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
        live &= ~keys_before(t, first);
        __m512 x = _mm512_maskz_loadu_ps(live, row + t);
        __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(x, m)));
        _mm512_storeu_ps(row + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* acc[g] += sum over `count` tokens of p[g][t] * v_scale * V[t] for one kv head's GROUP query
 * heads; the accumulators stay in registers over the block. */
ALWAYS_INLINE void weigh_block(const uint8_t *rows, int64_t count, int64_t stride,
                               const float *probs, int64_t padded, float v_scale, float *acc,
                               Prefetch *fetch, int64_t share, int DIM, int GROUP, int codes) {
    const int V = DIM / 16;
    __m512 sum[MAX_GROUP][MAX_VECS];
    for (int g = 0; g < GROUP; g++)
        for (int v = 0; v < V; v++) sum[g][v] = _mm512_loadu_ps(acc + g * DIM + 16 * v);
    for (int64_t t = 0; t < count; t++) {
        prefetch_some(fetch, share);
        __m512 x[MAX_VECS];
        for (int v = 0; v < V; v++) x[v] = decode16(rows + t * stride + 16 * v, codes);
        for (int g = 0; g < GROUP; g++) {
            __m512 p = _mm512_set1_ps(probs[g * padded + t] * v_scale);
            for (int v = 0; v < V; v++) sum[g][v] = _mm512_fmadd_ps(p, x[v], sum[g][v]);
        }
    }
    for (int g = 0; g < GROUP; g++)
        for (int v = 0; v < V; v++) _mm512_storeu_ps(acc + g * DIM + 16 * v, sum[g][v]);
}

#if HAVE_VNNI
/* weigh_block for int8 V codes (bf16 queries): per 16-token chunk and head, the weights become
 * int16 (step = the chunk's largest / 32767, finer than a bf16 weight) and pairs of tokens'
 * codes, widened to int16 and interleaved, meet them in VPDPWSSD: exact integer sums, turned
 * to float once per chunk. The interleave leaves each 32-wide column group in lane order
 * [0-3, 8-11, 16-19, 24-27 | 4-7, ...], undone at the float conversion. */
ALWAYS_INLINE void weigh_block_vnni(const uint8_t *rows, int64_t count, int64_t stride,
                                    const float *probs, int64_t padded, float v_scale,
                                    float *acc, Prefetch *fetch, int64_t share, int DIM,
                                    int GROUP) {
    const int W = DIM / 32; /* int16 vectors per row */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t c = 0; c < count; c += 16) {
        const int64_t n = count - c < 16 ? count - c : 16;
        const __mmask16 valid = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        int32_t pairs[MAX_GROUP][8];
        float step[MAX_GROUP];
        __m512i sum[MAX_GROUP][2 * (MAX_VECS / 2)];
        for (int g = 0; g < GROUP; g++) {
            __m512 p = _mm512_maskz_loadu_ps(valid, probs + g * padded + c);
            const float top = _mm512_reduce_max_ps(p);
            step[g] = top > 0 ? top / 32767 : 1.0f;
            __m512i p16 = _mm512_cvtps_epi32(_mm512_mul_ps(p, _mm512_set1_ps(1.0f / step[g])));
            _mm256_storeu_si256((__m256i *)pairs[g], _mm512_cvtepi32_epi16(p16));
            for (int w = 0; w < 2 * W; w++) sum[g][w] = _mm512_setzero_si512();
        }
        /* An odd n reads one slot past the last token: a real slot of the block, weight 0. */
        for (int64_t t = 0; t < n; t += 2) {
            prefetch_some(fetch, 2 * share);
            const uint8_t *row = rows + (c + t) * stride;
            __m512i lo[MAX_VECS / 2], hi[MAX_VECS / 2];
            for (int w = 0; w < W; w++) {
                __m512i x0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * w)));
                __m512i x1 = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(row + stride + 32 * w)));
                lo[w] = _mm512_unpacklo_epi16(x0, x1);
                hi[w] = _mm512_unpackhi_epi16(x0, x1);
            }
            for (int g = 0; g < GROUP; g++) {
                __m512i p = _mm512_set1_epi32(pairs[g][t / 2]);
                for (int w = 0; w < W; w++) {
                    sum[g][2 * w] = _mm512_dpwssd_epi32(sum[g][2 * w], lo[w], p);
                    sum[g][2 * w + 1] = _mm512_dpwssd_epi32(sum[g][2 * w + 1], hi[w], p);
                }
            }
        }
        for (int g = 0; g < GROUP; g++) {
            const __m512 factor = _mm512_set1_ps(step[g] * v_scale);
            for (int w = 0; w < W; w++) {
                __m512 lo = _mm512_cvtepi32_ps(sum[g][2 * w]), hi = _mm512_cvtepi32_ps(sum[g][2 * w + 1]);
                float *dst = acc + g * DIM + 32 * w;
                _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, first, hi), factor,
                                                      _mm512_loadu_ps(dst)));
                _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, second, hi),
                                                           factor, _mm512_loadu_ps(dst + 16)));
            }
        }
    }
}
#endif

ALWAYS_INLINE void weigh_values(const DecodeAttention *a, int seq, const int64_t *table,
                                int64_t len, const Scratch *s, int64_t padded, int DIM,
                                int GROUP, int codes, int vnni) {
    const int hkv = a->num_kv_heads, bs = a->block_size, heads = a->num_q_heads;
    const int64_t stride = (int64_t)hkv * DIM, block_bytes = bs * stride;
    const int64_t blocks = (len + bs - 1) / bs;
    for (int64_t i = 0; i < (int64_t)heads * DIM; i += 16)
        _mm512_storeu_ps(s->acc + i, _mm512_setzero_ps());
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t block = table[b], start = b * bs;
        const uint8_t *rows = (const uint8_t *)a->v_cache + block * block_bytes;
        const int64_t count = len - start < bs ? len - start : bs;
        Prefetch fetch = block_ahead(a, table, blocks, 1, b, block_bytes);
        const int64_t share = (block_bytes / (hkv * count) + 63) & ~(int64_t)63;
        for (int kv = 0; kv < hkv; kv++) {
            const float *probs = s->scores + kv * GROUP * padded + start;
            const float v_scale = a->v_scales[block * hkv + kv] * code_factor(codes);
            float *sums = s->acc + kv * GROUP * DIM;
#if HAVE_VNNI
            if (vnni) {
                weigh_block_vnni(rows + kv * DIM, count, stride, probs, padded, v_scale, sums,
                                 &fetch, share, DIM, GROUP);
                continue;
            }
#endif
            weigh_block(rows + kv * DIM, count, stride, probs, padded, v_scale, sums, &fetch,
                        share, DIM, GROUP, codes);
        }
    }
    for (int h = 0; h < heads; h++) {
        const int64_t row = ((int64_t)seq * heads + h) * DIM;
        __m512 inv = _mm512_set1_ps(1.0f / s->denom[h]);
        for (int v = 0; v < DIM / 16; v++)
            store_out(a, row, v, _mm512_mul_ps(_mm512_loadu_ps(s->acc + h * DIM + 16 * v), inv));
    }
}

ALWAYS_INLINE void attend_seq(const DecodeAttention *a, int seq, const Scratch *s, int DIM,
                              int GROUP, int codes) {
    /* whole blocks before the window are skipped: table and len from the window's block */
    const int64_t window_key = window_first_key(a->seq_lens[seq], a->sliding_window);
    const int64_t skipped = window_key / a->block_size * a->block_size;
    const int64_t len = a->seq_lens[seq] - skipped, first = window_key - skipped;
    const int64_t padded = (len + 15) / 16 * 16;
    const int64_t *table = a->block_tables + (int64_t)seq * a->max_blocks + skipped / a->block_size;
    /* VNNI scores need int8 codes and bfloat16 queries: with float32 queries the int16
     * rounding would be the largest error left, so those keep the float path. */
    const int vnni = HAVE_VNNI && codes == 1 && a->is_bf16;
    prepare_queries(a, seq, s, DIM, vnni);
    score_keys(a, table, len, first, s, padded, DIM, GROUP, codes, vnni);
    for (int h = 0; h < a->num_q_heads; h++)
        s->denom[h] = softmax_row(s->scores + h * padded, len, first, s->top[h]);
    weigh_values(a, seq, table, len, s, padded, DIM, GROUP, codes, vnni);
}

/* head_dim 256 at one query head per kv head is left to the portable loop: every shape here
 * costs seconds of the first-use build, and Gemma 3 has 2 or 4 per kv head. */
#define Q8_SHAPES(X) X(64, 1) X(64, 2) X(64, 3) X(64, 4) X(64, 8) \
                     X(128, 1) X(128, 2) X(128, 4) X(128, 8) X(256, 2) X(256, 4)
#define SPECIALISE(DIM, GROUP)                                                            \
    static void attend_q8_##DIM##_##GROUP(const DecodeAttention *a, int seq,               \
                                          const Scratch *s) {                             \
        switch (a->kv_codes) {                                                            \
        case 1: attend_seq(a, seq, s, DIM, GROUP, 1); break;                              \
        case 2: attend_seq(a, seq, s, DIM, GROUP, 2); break;                              \
        default: attend_seq(a, seq, s, DIM, GROUP, 3);                                    \
        }                                                                                 \
    }
Q8_SHAPES(SPECIALISE)

typedef void (*AttendQ8)(const DecodeAttention *, int, const Scratch *);

static AttendQ8 pick(int dim, int group) {
#define CASE(DIM, GROUP) if (dim == DIM && group == GROUP) return attend_q8_##DIM##_##GROUP;
    Q8_SHAPES(CASE)
#undef CASE
    return NULL;
}

int decode_attention_q8_avx512_supported(const DecodeAttention *a) {
    if (a->kv_codes < 1 || a->kv_codes > 3 || a->num_kv_heads <= 0 || a->block_size % 16)
        return 0;
    if (a->num_q_heads % a->num_kv_heads || a->q_stride % a->head_dim) return 0;
    return pick(a->head_dim, a->num_q_heads / a->num_kv_heads) != NULL;
}

/* One allocation per thread for its Scratch; returns it (to free), NULL when out of memory. */
static void *make_scratch(const DecodeAttention *a, int64_t padded, Scratch *s) {
    const size_t heads = (size_t)a->num_q_heads, dim = (size_t)a->head_dim;
    const size_t floats = heads * (size_t)padded + 2 * heads * dim + 4 * heads;
    const size_t bytes = floats * 4 + 2 * heads * dim;
    char *buffer = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (buffer == NULL) return NULL;
    s->scores = (float *)buffer;
    s->q = s->scores + heads * padded;
    s->acc = s->q + heads * dim;
    s->top = s->acc + heads * dim;
    s->denom = s->top + heads;
    s->q_step = s->denom + heads;
    s->q_offset = (int32_t *)(s->q_step + heads);
    s->q_hi = (int8_t *)(s->q_offset + heads);
    s->q_lo = s->q_hi + heads * dim;
    return buffer;
}

void decode_attention_q8_avx512_team(const DecodeAttention *a, int *failed) {
    AttendQ8 attend = pick(a->head_dim, a->num_q_heads / a->num_kv_heads);
    int64_t longest = 16;
    for (int s = 0; s < a->num_seqs; s++)
        if (a->seq_lens[s] > longest) longest = a->seq_lens[s];
    Scratch scratch;
    void *buffer = make_scratch(a, (longest + 15) / 16 * 16, &scratch);
    if (!buffer) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int seq = 0; seq < a->num_seqs; seq++)
        if (buffer) attend(a, seq, &scratch);
    free(buffer);
}

#else /* no AVX-512 (BW) or F16C: the portable loop serves every 8-bit pool */

int decode_attention_q8_avx512_supported(const DecodeAttention *a) { return 0; }
void decode_attention_q8_avx512_team(const DecodeAttention *a, int *failed) {}

#endif
