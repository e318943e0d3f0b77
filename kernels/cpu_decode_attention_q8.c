/* Paged decode attention over an 8-bit KV pool with AVX-512: the fast path that
 * cpu_decode_attention.c tries first for int8 / fp8 codes (its portable loop serves the rest).
 *
 * The portable loop is bound by instructions, not bytes: each row is decoded through a stack
 * buffer and each q.k dot ends in a horizontal sum. Here
 *   - 16 codes become 16 float32 lanes in registers: int8 by sign extension and conversion;
 *     e5m2 is the high byte of a float16 (shift, then VCVTPH2PS); e4m3 is re-packed as a
 *     float16 of 1/256 of its value (the 256 joins the block's scale). Subnormal codes convert
 *     exactly: VCVTPH2PS does not flush float16 denormals;
 *   - the scores of 16 keys against one query head are 16 vector FMA chains summed at once by
 *     a transpose-add tree (sum16), and the block's K scale multiplies the 16 sums;
 *   - the V pass keeps one kv head's query-head accumulators in registers and folds the V
 *     scale into each softmax weight.
 * One kv head at a time per sequence (its query heads' q rows stay in registers for the whole
 * pass). Block sizes must be multiples of 16: a 16-key chunk never crosses a block, and keys
 * past seq_len inside the last block are real slots (read, then masked).
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team_ops.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>

#include "cpu_x86_common.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_GROUP 8
#define MAX_VECS 8 /* float32 vectors per head row: head_dim 128 */

/* 16 codes -> 16 floats (e4m3: 1/256 of the value, see code_factor). */
ALWAYS_INLINE __m512 decode16(const uint8_t *src, int codes) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)src);
    if (codes == 1) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    __m256i wide = _mm256_cvtepu8_epi16(bytes);
    if (codes == 3) return _mm512_cvtph_ps(_mm256_slli_epi16(wide, 8));
    __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7F)), 7);
    __m256i sign = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(magnitude, sign));
}

static float code_factor(int codes) { return codes == 2 ? 256.0f : 1.0f; }

/* Blocks are scattered, so the hardware prefetchers stop at each block boundary: request the
 * kv head's rows of the next 16-key chunk (one cache line each at D = 64) before computing
 * this one, so their misses overlap the arithmetic. */
ALWAYS_INLINE void prefetch_chunk(const DecodeAttention *a, const uint8_t *cache,
                                  const int64_t *table, int64_t start, int64_t len, int kv,
                                  int DIM) {
    if (start >= len) return;
    const int64_t bs = a->block_size, hkv = a->num_kv_heads;
    const uint8_t *rows = cache + ((table[start / bs] * bs + start % bs) * hkv + kv) * DIM;
    for (int t = 0; t < 16; t++)
        for (int byte = 0; byte < DIM; byte += 64)
            _mm_prefetch((const char *)rows + t * hkv * DIM + byte, _MM_HINT_T0);
}

ALWAYS_INLINE __m512 load_query(const DecodeAttention *a, int64_t row, int v) {
    if (a->is_bf16) {
        const uint16_t *src = (const uint16_t *)a->q + row + 16 * v;
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
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

/* Scores of every key of `seq` against the GROUP query heads of kv head `kv`, scaled; the
 * rows of `scores` are padded to whole chunks of 16 (no infinities: -ffast-math). */
ALWAYS_INLINE void score_pass(const DecodeAttention *a, int seq, int kv, float *scores,
                              int64_t padded, float *top, int DIM, int GROUP, int codes) {
    const int V = DIM / 16, hkv = a->num_kv_heads, bs = a->block_size;
    const int64_t len = a->seq_lens[seq], *table = a->block_tables + (int64_t)seq * a->max_blocks;
    __m512 q[MAX_GROUP][MAX_VECS], best[MAX_GROUP];
    for (int g = 0; g < GROUP; g++) {
        int64_t row = (int64_t)seq * a->q_stride + (int64_t)(kv * GROUP + g) * DIM;
        for (int v = 0; v < V; v++)
            q[g][v] = _mm512_mul_ps(load_query(a, row, v), _mm512_set1_ps(a->scale));
        best[g] = _mm512_set1_ps(-FLT_MAX);
    }
    for (int64_t start = 0; start < len; start += 16) {
        int64_t block = table[start / bs];
        const uint8_t *rows = (const uint8_t *)a->k_cache +
                              ((block * bs + start % bs) * hkv + kv) * DIM;
        prefetch_chunk(a, a->k_cache, table, start + 32, len, kv, DIM);
        __m512 dots[MAX_GROUP][16];
        for (int t = 0; t < 16; t++) {
            __m512 k[MAX_VECS];
            for (int v = 0; v < V; v++) k[v] = decode16(rows + (int64_t)t * hkv * DIM + 16 * v, codes);
            for (int g = 0; g < GROUP; g++) {
                __m512 acc = _mm512_mul_ps(q[g][0], k[0]);
                for (int v = 1; v < V; v++) acc = _mm512_fmadd_ps(q[g][v], k[v], acc);
                dots[g][t] = acc;
            }
        }
        __m512 row_scale = _mm512_set1_ps(a->k_scales[block * hkv + kv] * code_factor(codes));
        __mmask16 valid = len - start >= 16 ? 0xFFFF : (__mmask16)((1u << (len - start)) - 1);
        for (int g = 0; g < GROUP; g++) {
            __m512 s = _mm512_mul_ps(sum16(dots[g]), row_scale);
            _mm512_storeu_ps(scores + g * padded + start, s);
            best[g] = _mm512_mask_max_ps(best[g], valid, best[g], s);
        }
    }
    for (int g = 0; g < GROUP; g++) top[g] = _mm512_reduce_max_ps(best[g]);
}

/* exp(score - top) in place for the len keys (the padding gets 0); returns their sum. */
ALWAYS_INLINE float softmax_row(float *row, int64_t len, float top) {
    __m512 sum = _mm512_setzero_ps(), m = _mm512_set1_ps(top);
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 live = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
        __m512 s = _mm512_maskz_loadu_ps(live, row + t);
        __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(s, m)));
        _mm512_storeu_ps(row + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

ALWAYS_INLINE void value_pass(const DecodeAttention *a, int seq, int kv, const float *weights,
                              int64_t padded, const float *denom, int DIM, int GROUP, int codes) {
    const int V = DIM / 16, hkv = a->num_kv_heads, bs = a->block_size;
    const int64_t len = a->seq_lens[seq], *table = a->block_tables + (int64_t)seq * a->max_blocks;
    __m512 acc[MAX_GROUP][MAX_VECS];
    for (int g = 0; g < GROUP; g++)
        for (int v = 0; v < V; v++) acc[g][v] = _mm512_setzero_ps();
    for (int64_t start = 0; start < len; start += 16) {
        int64_t block = table[start / bs];
        const uint8_t *rows = (const uint8_t *)a->v_cache +
                              ((block * bs + start % bs) * hkv + kv) * DIM;
        float row_scale = a->v_scales[block * hkv + kv] * code_factor(codes);
        int64_t count = len - start < 16 ? len - start : 16;
        prefetch_chunk(a, a->v_cache, table, start + 32, len, kv, DIM);
        for (int64_t t = 0; t < count; t++) {
            __m512 x[MAX_VECS];
            for (int v = 0; v < V; v++) x[v] = decode16(rows + t * hkv * DIM + 16 * v, codes);
            for (int g = 0; g < GROUP; g++) {
                __m512 p = _mm512_set1_ps(weights[g * padded + start + t] * row_scale);
                for (int v = 0; v < V; v++) acc[g][v] = _mm512_fmadd_ps(p, x[v], acc[g][v]);
            }
        }
    }
    for (int g = 0; g < GROUP; g++) {
        int64_t row = ((int64_t)seq * a->num_q_heads + kv * GROUP + g) * DIM;
        __m512 inv = _mm512_set1_ps(1.0f / denom[g]);
        for (int v = 0; v < V; v++) store_out(a, row, v, _mm512_mul_ps(acc[g][v], inv));
    }
}

ALWAYS_INLINE void attend_seq(const DecodeAttention *a, int seq, float *scores, int DIM,
                              int GROUP, int codes) {
    const int64_t padded = (a->seq_lens[seq] + 15) / 16 * 16;
    float top[MAX_GROUP], denom[MAX_GROUP];
    for (int kv = 0; kv < a->num_kv_heads; kv++) {
        score_pass(a, seq, kv, scores, padded, top, DIM, GROUP, codes);
        for (int g = 0; g < GROUP; g++)
            denom[g] = softmax_row(scores + g * padded, a->seq_lens[seq], top[g]);
        value_pass(a, seq, kv, scores, padded, denom, DIM, GROUP, codes);
    }
}

#define Q8_SHAPES(X) X(64, 1) X(64, 2) X(64, 3) X(64, 4) X(64, 8) \
                     X(128, 1) X(128, 2) X(128, 4) X(128, 8)
#define SPECIALISE(DIM, GROUP)                                                         \
    static void attend_q8_##DIM##_##GROUP(const DecodeAttention *a, int seq, float *s) { \
        switch (a->kv_codes) {                                                         \
        case 1: attend_seq(a, seq, s, DIM, GROUP, 1); break;                           \
        case 2: attend_seq(a, seq, s, DIM, GROUP, 2); break;                           \
        default: attend_seq(a, seq, s, DIM, GROUP, 3);                                 \
        }                                                                              \
    }
Q8_SHAPES(SPECIALISE)

typedef void (*AttendQ8)(const DecodeAttention *, int, float *);

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

void decode_attention_q8_avx512_team(const DecodeAttention *a, int *failed) {
    AttendQ8 attend = pick(a->head_dim, a->num_q_heads / a->num_kv_heads);
    int64_t longest = 16;
    for (int s = 0; s < a->num_seqs; s++)
        if (a->seq_lens[s] > longest) longest = a->seq_lens[s];
    float *scores = malloc(sizeof(float) * MAX_GROUP * (size_t)((longest + 15) / 16 * 16));
    if (!scores) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int seq = 0; seq < a->num_seqs; seq++)
        if (scores) attend(a, seq, scores);
    free(scores);
}

#else /* no AVX-512 (BW) or F16C: the portable loop serves every 8-bit pool */

int decode_attention_q8_avx512_supported(const DecodeAttention *a) { return 0; }
void decode_attention_q8_avx512_team(const DecodeAttention *a, int *failed) {}

#endif
