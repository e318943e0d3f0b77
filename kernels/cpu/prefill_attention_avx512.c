/* Causal attention of one prefill chunk with AVX-512 BF16 (VDPBF16PS), flash-attention style:
 * the path for CPUs that have AVX-512 BF16 but no AMX (prefill_attention_amx.c is tried
 * first). Without it such CPUs gathered the sequence's blocks and ran masked SDPA, the largest
 * cost of long prompts over a cached context (bench/README.md).
 *
 * The chunk's q_len queries sit at positions context_len - q_len .. context_len - 1 of a
 * sequence whose K/V (context_len tokens, the chunk's own included) are in the paged cache,
 * read in place through the block table (no gathered copy). A work item is one kv head's group
 * of query heads (or part of it, when whole groups would leave threads idle) for 16 query rows;
 * it walks the keys in steps of 16 up to its causal limit.
 * Everything is kept transposed, with the 16 query rows in the 16 float32 lanes:
 *   - S^T = K Q^T: per key one vector of 16 scores, from the query block packed as dim pairs
 *     (lane r = q_r[2p], q_r[2p + 1]) times the key's pair broadcast from the cache row;
 *   - the online softmax is then lane-wise (row maxima and sums are plain vectors, no
 *     horizontal reductions), exp written out as 2^x (x86_common.h), float32;
 *   - P is rounded to bf16 (as the AMX kernel and GPU flash attention do) with the pairs of
 *     keys interleaved per lane, and O^T[d] += P pair . (V[k][d], V[k + 1][d]) broadcast, the
 *     V pairs packed once per 16 keys for all heads of the group; O^T rescaled in float32,
 *     and only when a row's maximum grew (past the first keys it rarely does).
 * That is the VDPBF16PS form. Where VDPBF16PS multiplies slower than float32 FMAs (Intel
 * Xeons without usable AMX: one issue per two cycles against two FMAs per cycle; timed once,
 * x86_common.h) the float32 form runs instead: the queries, and each step's K and V rows once
 * for all heads of the group, widened to float32 (exact), S^T by FMAs with the key's value
 * broadcast, P kept in float32 and O^T[d] += P[k] x V[k][d] broadcast. Same loop, same online
 * softmax; P is not rounded, so its results differ from the VDPBF16PS form's in low bits.
 * Layouts: q rows q_stride elements apart, heads and head_dim contiguous (a view of the fused
 * QKV output); K/V cache [N, block_size, H_kv, D]; out contiguous [q_len, H_q, D].
 *
 * 8-bit pools (kernels/kv_quant.py: codes, one float32 scale per block, K/V and KV head) take
 * the same loop: per step of 16 keys their K and V rows are decoded to bf16 into the thread's
 * scratch (kv_codes.h; exact: int8 and both fp8 formats fit in bf16's 8 significant bits),
 * and the scales stay in float32: each key's K scale multiplies its score vector, its V scale
 * its softmax weight before the bf16 rounding of P. So the codes add no rounding of their own,
 * where scaling them to bf16 values would (code x scale rounded to 8 bits), and no gathered
 * bf16 copy of the context is written or read.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefill_items.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "kv_codes.h"
#include "x86_common.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define KEYS 16 /* keys per step: one score vector each, 8 key pairs for P V */
#define MAX_DIM 256

typedef struct {
    const uint16_t *q;
    const void *k_cache, *v_cache; /* bf16 values, or 8-bit codes (then scales per block) */
    const float *k_scales, *v_scales; /* [N, H_kv]: value = code * scale (8-bit pools) */
    const int64_t *table;
    uint16_t *out;
    int64_t q_stride, context_len, q_len;
    int num_q_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int codes;          /* 0: bf16 pool; 1 int8, 2 fp8 e4m3, 3 fp8 e5m2 (kv_codes.h) */
    int window;         /* > 0: row at p sees keys in (p - window, p]; 0: keys 0..p */
    int heads_per_item; /* a divisor of the group (query heads per kv head) */
    int wide;           /* 1: the float32 FMA form, 0: VDPBF16PS */
    /* NULL, or the V pairs of every step from step packed_from on (the first any row of the
     * chunk sees), packed once for all the items that read them:
     * [steps of KEYS][num_kv_heads][KEYS / 2][head_dim] (pack_chunk_values) */
    const uint32_t *v_packed;
    int64_t packed_from;
} Chunk;

/* One thread's state for a work item of `heads` (heads_per_item) query heads. */
typedef struct {
    float *out;       /* [heads][head_dim][16]: O^T, unnormalised */
    uint32_t *q;      /* [heads][head_dim / 2][16]: query dim pairs per row */
    __m512 *max, *sum; /* [heads]: raw-score maxima and sums of p per row */
    uint32_t *v_pairs; /* [KEYS / 2][head_dim]: (V[2i][d], V[2i + 1][d]) of the step's keys */
    uint16_t *k_decoded, *v_decoded; /* [KEYS][head_dim]: the step's rows of an 8-bit pool */
    float *k_scale, *v_scale;        /* [KEYS]: their blocks' scales (times code_factor) */
    float *q_wide;                   /* float32 form: [heads][head_dim][16] query rows in lanes */
    float *k_wide, *v_wide;          /* float32 form: [KEYS][head_dim], the step's rows */
} Scratch;

static const uint16_t zero_row[MAX_DIM]; /* the rows past the context (masked anyway) */

/* element 2j from a[j], 2j + 1 from b[j]: pairs of two rows of bf16, dims 0-15 and 16-31 */
static const uint16_t pair_low[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t pair_high[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54,
                                       23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61,
                                       30, 62, 31, 63};
/* element 2j from element j, 2j + 1 from element 16 + j: [e0 | e1] -> (e0[j], e1[j]) pairs */
static const uint16_t pair_lanes[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                        15, 31};

#if PAGEDGEN_HAVE_KV_CODES
/* D codes -> D bf16 values of code / code_factor (exact). */
ALWAYS_INLINE void decode_row(const uint8_t *src, uint16_t *dst, int D, int codes) {
    for (int d = 0; d < D; d += 32)
        _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(decode16(src + d + 16, codes),
                                                                  decode16(src + d, codes)));
}
#endif

/* An 8-bit pool's key `k` of the step: its rows decoded into the scratch, its scales. */
ALWAYS_INLINE void decode_key(const Chunk *c, int64_t block, int64_t at, int kv, int k,
                              Scratch *s, const uint16_t **k_rows, const uint16_t **v_rows,
                              int D, int codes) {
#if PAGEDGEN_HAVE_KV_CODES
    decode_row((const uint8_t *)c->k_cache + at, s->k_decoded + k * D, D, codes);
    decode_row((const uint8_t *)c->v_cache + at, s->v_decoded + k * D, D, codes);
    k_rows[k] = s->k_decoded + k * D;
    v_rows[k] = s->v_decoded + k * D;
    const int64_t scale_at = c->table[block] * c->num_kv_heads + kv;
    s->k_scale[k] = c->k_scales[scale_at] * code_factor(codes);
    s->v_scale[k] = c->v_scales[scale_at] * code_factor(codes);
#endif
}

/* The K and V rows of keys key0 .. key0 + KEYS - 1 of kv head `kv` (block and offset stepped
 * along: a division per key cost a noticeable share of the step); for an 8-bit pool (codes
 * > 0), rows decoded into the scratch and the keys' scales. */
ALWAYS_INLINE void key_rows(const Chunk *c, int64_t key0, int kv, Scratch *s,
                            const uint16_t **k_rows, const uint16_t **v_rows, int D, int codes) {
    int64_t block = key0 / c->block_size, offset = key0 % c->block_size;
    for (int k = 0; k < KEYS; k++) {
        if (key0 + k >= c->context_len) { /* masked for every row: only kept finite */
            k_rows[k] = v_rows[k] = zero_row;
            if (codes) s->k_scale[k] = s->v_scale[k] = 0.0f;
        } else {
            const int64_t at =
                ((c->table[block] * c->block_size + offset) * c->num_kv_heads + kv) * D;
            if (codes) {
                decode_key(c, block, at, kv, k, s, k_rows, v_rows, D, codes);
            } else {
                k_rows[k] = (const uint16_t *)c->k_cache + at;
                v_rows[k] = (const uint16_t *)c->v_cache + at;
            }
        }
        if (++offset == c->block_size) {
            offset = 0;
            block++;
        }
    }
}

ALWAYS_INLINE uint32_t pair_at(const uint16_t *row, int p) {
    uint32_t word;
    memcpy(&word, row + 2 * p, 4);
    return word;
}

/* The rows of the item's query heads, as dim pairs with the rows in lanes (zero past q_len). */
static void pack_queries(const Chunk *c, int first_head, int64_t row0, int64_t rows, Scratch *s) {
    const int pairs = c->head_dim / 2;
    for (int h = 0; h < c->heads_per_item; h++) {
        uint32_t *dst = s->q + (int64_t)h * pairs * 16;
        const int head = first_head + h;
        for (int r = 0; r < 16; r++) {
            const uint16_t *src = c->q + (row0 + r) * c->q_stride + (int64_t)head * c->head_dim;
            for (int p = 0; p < pairs; p++) dst[p * 16 + r] = r < rows ? pair_at(src, p) : 0;
        }
    }
}

ALWAYS_INLINE void pack_value_pairs(const uint16_t *const *v_rows, uint32_t *v_pairs, int D) {
    const __m512i low = _mm512_loadu_si512(pair_low), high = _mm512_loadu_si512(pair_high);
    for (int i = 0; i < KEYS / 2; i++)
        for (int c = 0; c < D / 32; c++) {
            const __m512i a = _mm512_loadu_si512(v_rows[2 * i] + 32 * c);
            const __m512i b = _mm512_loadu_si512(v_rows[2 * i + 1] + 32 * c);
            _mm512_storeu_si512(v_pairs + i * D + 32 * c, _mm512_permutex2var_epi16(a, low, b));
            _mm512_storeu_si512(v_pairs + i * D + 32 * c + 16,
                                _mm512_permutex2var_epi16(a, high, b));
        }
}

/* The same rows as float32, one dim per vector (the float32 form). */
static void pack_queries_wide(const Chunk *c, int first_head, int64_t row0, int64_t rows,
                              Scratch *s) {
    const int D = c->head_dim;
    for (int h = 0; h < c->heads_per_item; h++) {
        float *dst = s->q_wide + (int64_t)h * D * 16;
        const int head = first_head + h;
        for (int r = 0; r < 16; r++) {
            const uint16_t *src = c->q + (row0 + r) * c->q_stride + (int64_t)head * D;
            for (int d = 0; d < D; d++) {
                const uint32_t bits = r < rows ? (uint32_t)src[d] << 16 : 0;
                memcpy(dst + d * 16 + r, &bits, 4);
            }
        }
    }
}

/* The step's KEYS rows (bf16) -> float32 rows (exact: bf16 is float32's upper half). */
ALWAYS_INLINE void widen_rows(const uint16_t *const *rows, float *wide, int D) {
    for (int k = 0; k < KEYS; k++)
        for (int d = 0; d < D; d += 16)
            _mm512_store_ps(wide + k * D + d, bf16x16_to_f32(rows[k] + d));
}

/* S^T of one head and the step's keys, VDPBF16PS form: lane r of s[k] = q_r . key k. */
ALWAYS_INLINE void scores_pairs(const uint32_t *q, const uint16_t *const *k_rows, __m512 *s,
                                int D) {
    for (int k = 0; k < KEYS; k++) s[k] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
        const __m512bh qv = (__m512bh)_mm512_load_si512(q + 16 * p);
#pragma GCC unroll 16
        for (int k = 0; k < KEYS; k++)
            s[k] = _mm512_dpbf16_ps(s[k], qv, (__m512bh)_mm512_set1_epi32(pair_at(k_rows[k], p)));
    }
}

/* The same in float32: one FMA per dim and key, the key's value broadcast. */
ALWAYS_INLINE void scores_wide(const float *q, const float *k_wide, __m512 *s, int D) {
    for (int k = 0; k < KEYS; k++) s[k] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        const __m512 qv = _mm512_load_ps(q + 16 * d);
#pragma GCC unroll 16
        for (int k = 0; k < KEYS; k++)
            s[k] = _mm512_fmadd_ps(qv, _mm512_set1_ps(k_wide[k * D + d]), s[k]);
    }
}

/* The online softmax of one head over the step's scores s (lane = query row), in place: s[k]
 * becomes key k's weight exp((s - max) * scale) (times its V scale for an 8-bit pool, whose
 * K scales multiply the scores first), *max and *sum move on. Returns the factor that O^T
 * must be multiplied by, and *rescale = 0 when no row's maximum grew (factor 1: the
 * multiply is skipped, which changes no bit). */
ALWAYS_INLINE __m512 softmax_step(__m512 *s, const Scratch *scratch, int64_t key0,
                                  int64_t first_pos, int window, float scale, __m512 *max,
                                  __m512 *sum, int codes, int *rescale) {
    if (codes)
        for (int k = 0; k < KEYS; k++)
            s[k] = _mm512_mul_ps(s[k], _mm512_set1_ps(scratch->k_scale[k]));
    /* causal mask: key key0 + k is seen by row r when key0 + k <= first_pos + r; a window
     * also hides it from the rows with key0 + k <= first_pos + r - window. A row may see none
     * of the 16 keys: its maximum stays, its weights are 0. */
    __mmask16 keep[KEYS];
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int masked = key0 + KEYS - 1 > first_pos || window > 0;
    __m512 m = *max;
    for (int k = 0; k < KEYS; k++) {
        const int distance = (int)(key0 + k - first_pos); /* key minus row 0's position */
        keep[k] = masked ? _mm512_cmpge_epi32_mask(lanes, _mm512_set1_epi32(distance)) : 0xffff;
        if (window > 0)
            keep[k] &= _mm512_cmplt_epi32_mask(lanes, _mm512_set1_epi32(distance + window));
        m = _mm512_mask_max_ps(m, keep[k], m, s[k]);
    }
    /* exp((s - m) scale) = 2^(s f - m f), f = scale log2(e): one FMA per vector */
    const __m512 factor = _mm512_set1_ps(scale * 1.44269504088896341f);
    const __m512 shift = _mm512_mul_ps(m, factor);
    *rescale = _mm512_cmp_ps_mask(m, *max, _CMP_NEQ_OQ) != 0;
    const __m512 alpha = *rescale ? exp2_nonpositive(_mm512_fmsub_ps(*max, factor, shift))
                                  : _mm512_set1_ps(1.0f);
    *max = m;
    __m512 block_sum = _mm512_setzero_ps();
    for (int i = 0; i < KEYS / 2; i++) {
        const __m512 e0 = _mm512_maskz_mov_ps(
            keep[2 * i], exp2_nonpositive(_mm512_fmsub_ps(s[2 * i], factor, shift)));
        const __m512 e1 = _mm512_maskz_mov_ps(
            keep[2 * i + 1], exp2_nonpositive(_mm512_fmsub_ps(s[2 * i + 1], factor, shift)));
        block_sum = _mm512_add_ps(block_sum, _mm512_add_ps(e0, e1));
        s[2 * i] = e0;
        s[2 * i + 1] = e1;
    }
    if (codes) /* P V = sum p (v_scale x code): the scale joins the weight */
        for (int k = 0; k < KEYS; k++)
            s[k] = _mm512_mul_ps(s[k], _mm512_set1_ps(scratch->v_scale[k]));
    *sum = _mm512_fmadd_ps(*sum, alpha, block_sum);
    return alpha;
}

/* O^T = O^T x alpha + P V, VDPBF16PS form: P rounded to bf16, key pairs interleaved per lane. */
ALWAYS_INLINE void values_pairs(const __m512 *weights, const uint32_t *v_pairs, __m512 alpha,
                                int rescale, float *out, int D) {
    __m512bh p[KEYS / 2];
    const __m512i interleave = _mm512_loadu_si512(pair_lanes);
    for (int i = 0; i < KEYS / 2; i++) {
        /* [bf16(e0) | bf16(e1)] -> lane j = (e0[j], e1[j]), the even key in the low half */
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(weights[2 * i + 1], weights[2 * i]);
        p[i] = (__m512bh)_mm512_permutexvar_epi16(interleave, both);
    }
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 acc[16];
        for (int j = 0; j < 16; j++) {
            acc[j] = _mm512_load_ps(out + (d0 + j) * 16);
            if (rescale) acc[j] = _mm512_mul_ps(acc[j], alpha);
        }
        for (int i = 0; i < KEYS / 2; i++)
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], p[i],
                                          (__m512bh)_mm512_set1_epi32(v_pairs[i * D + d0 + j]));
        for (int j = 0; j < 16; j++) _mm512_store_ps(out + (d0 + j) * 16, acc[j]);
    }
}

/* The same in float32: P as computed, one FMA per key and dim, V's value broadcast. Eight
 * dims at a time, so the 16 weights and the accumulators stay in registers. */
ALWAYS_INLINE void values_wide(const __m512 *weights, const float *v_wide, __m512 alpha,
                               int rescale, float *out, int D) {
    for (int d0 = 0; d0 < D; d0 += 8) {
        __m512 acc[8];
        for (int j = 0; j < 8; j++) {
            acc[j] = _mm512_load_ps(out + (d0 + j) * 16);
            if (rescale) acc[j] = _mm512_mul_ps(acc[j], alpha);
        }
        for (int k = 0; k < KEYS; k++)
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                acc[j] = _mm512_fmadd_ps(weights[k], _mm512_set1_ps(v_wide[k * D + d0 + j]),
                                         acc[j]);
        for (int j = 0; j < 8; j++) _mm512_store_ps(out + (d0 + j) * 16, acc[j]);
    }
}

/* One query head, 16 keys from key0: scores, online softmax, O^T update, in the float32 form
 * (wide) or the VDPBF16PS one (v_pairs: the step's V pairs). */
ALWAYS_INLINE void attend_keys(int h, const uint16_t *const *k_rows, const uint32_t *v_pairs,
                               const Scratch *scratch, int64_t key0, int64_t first_pos,
                               int window, float scale, int D, int codes, int wide) {
    __m512 s[KEYS];
    if (wide)
        scores_wide(scratch->q_wide + (int64_t)h * D * 16, scratch->k_wide, s, D);
    else
        scores_pairs(scratch->q + (int64_t)h * D / 2 * 16, k_rows, s, D);
    int rescale;
    const __m512 alpha = softmax_step(s, scratch, key0, first_pos, window, scale,
                                      &scratch->max[h], &scratch->sum[h], codes, &rescale);
    float *out = scratch->out + (int64_t)h * D * 16;
    if (wide)
        values_wide(s, scratch->v_wide, alpha, rescale, out, D);
    else
        values_pairs(s, v_pairs, alpha, rescale, out, D);
}

/* O^T / sum of one head -> its rows of out (bf16). */
static void write_rows(const Chunk *c, int head, int64_t row0, int64_t rows, const float *out,
                       __m512 sum) {
    float row[16][MAX_DIM] __attribute__((aligned(64)));
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
    for (int d = 0; d < c->head_dim; d++) {
        float lane[16] __attribute__((aligned(64)));
        _mm512_store_ps(lane, _mm512_mul_ps(_mm512_load_ps(out + d * 16), inv));
        for (int r = 0; r < 16; r++) row[r][d] = lane[r];
    }
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = c->out + ((row0 + r) * c->num_q_heads + head) * c->head_dim;
        for (int d = 0; d < c->head_dim; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row[r] + d)));
    }
}

/* 16 query rows (from `row0`) of query heads first_head .. + heads_per_item (one kv head's). */
ALWAYS_INLINE void attend_item(const Chunk *c, int first_head, int64_t row0, Scratch *s, int D,
                               int codes, int wide) {
    const int heads = c->heads_per_item, kv = first_head / (c->num_q_heads / c->num_kv_heads);
    const int64_t rows = c->q_len - row0 < 16 ? c->q_len - row0 : 16;
    const int64_t first_pos = c->context_len - c->q_len + row0;
    const int64_t last_key = first_pos + rows - 1; /* causal limit of the item's last row */
    if (wide)
        pack_queries_wide(c, first_head, row0, rows, s);
    else
        pack_queries(c, first_head, row0, rows, s);
    memset(s->out, 0, sizeof(float) * heads * D * 16);
    for (int h = 0; h < heads; h++) {
        s->max[h] = _mm512_set1_ps(-FLT_MAX); /* replaced by each row's first seen key */
        s->sum[h] = _mm512_setzero_ps();
    }
    /* nothing before row 0's window is read (from its step's start: the keys before the
     * window are masked) */
    const int64_t first_key = prefill_window_first_step(first_pos, c->window, KEYS) * KEYS;
    const uint16_t *k_rows[KEYS], *v_rows[KEYS];
    for (int64_t key0 = first_key; key0 <= last_key; key0 += KEYS) {
        key_rows(c, key0, kv, s, k_rows, v_rows, D, codes);
        const uint32_t *v_pairs = s->v_pairs;
        if (wide) { /* once for every head of the group */
            widen_rows(k_rows, s->k_wide, D);
            widen_rows(v_rows, s->v_wide, D);
        } else if (c->v_packed != NULL) {
            v_pairs = c->v_packed +
                      ((key0 / KEYS - c->packed_from) * c->num_kv_heads + kv) * (KEYS / 2) * D;
        } else {
            pack_value_pairs(v_rows, s->v_pairs, D);
        }
        for (int h = 0; h < heads; h++)
            attend_keys(h, k_rows, v_pairs, s, key0, first_pos, c->window, c->scale, D, codes,
                        wide);
    }
    for (int h = 0; h < heads; h++)
        write_rows(c, first_head + h, row0, rows, s->out + (int64_t)h * D * 16, s->sum[h]);
}

typedef void (*AttendItem)(const Chunk *, int, int64_t, Scratch *);

#define SPECIALISE(DIM, CODES)                                                              \
    static void attend_item_##DIM##_##CODES(const Chunk *c, int first_head, int64_t row0,   \
                                            Scratch *s) {                                   \
        attend_item(c, first_head, row0, s, DIM, CODES, 0);                                 \
    }                                                                                       \
    static void attend_wide_##DIM##_##CODES(const Chunk *c, int first_head, int64_t row0,   \
                                            Scratch *s) {                                   \
        attend_item(c, first_head, row0, s, DIM, CODES, 1);                                 \
    }
#if PAGEDGEN_HAVE_KV_CODES
#define ITEM_SHAPES(X) X(64, 0) X(128, 0) X(256, 0) X(64, 1) X(128, 1) X(256, 1) \
                       X(64, 2) X(128, 2) X(256, 2) X(64, 3) X(128, 3) X(256, 3)
#else
#define ITEM_SHAPES(X) X(64, 0) X(128, 0) X(256, 0)
#endif
ITEM_SHAPES(SPECIALISE)

static AttendItem pick(int head_dim, int codes, int wide) {
#define CASE(DIM, CODES)                        \
    if (head_dim == DIM && codes == CODES)      \
        return wide ? attend_wide_##DIM##_##CODES : attend_item_##DIM##_##CODES;
    ITEM_SHAPES(CASE)
#undef CASE
    return NULL;
}

/* One allocation per thread; returns it (to free), NULL when out of memory. */
static void *make_scratch(int heads, int head_dim, Scratch *s) {
    const size_t out = (size_t)heads * head_dim * 16 * 4, q = (size_t)heads * head_dim / 2 * 16 * 4;
    const size_t stats = (size_t)heads * 64 * 2, pairs = (size_t)KEYS / 2 * head_dim * 4;
    const size_t decoded = (size_t)KEYS * head_dim * 2, scales = KEYS * 4;
    const size_t q_wide = 2 * q, rows_wide = (size_t)KEYS * head_dim * 4;
    /* each a multiple of 64 */
    char *buffer = aligned_alloc(64, out + q + stats + pairs + 2 * decoded + 2 * scales +
                                         q_wide + 2 * rows_wide);
    if (buffer == NULL) return NULL;
    s->out = (float *)buffer;
    s->q = (uint32_t *)(buffer + out);
    s->max = (__m512 *)(buffer + out + q);
    s->sum = s->max + heads;
    s->v_pairs = (uint32_t *)(buffer + out + q + stats);
    s->k_decoded = (uint16_t *)(buffer + out + q + stats + pairs);
    s->v_decoded = s->k_decoded + KEYS * head_dim;
    s->k_scale = (float *)(s->v_decoded + KEYS * head_dim);
    s->v_scale = s->k_scale + KEYS;
    s->q_wide = (float *)(buffer + out + q + stats + pairs + 2 * decoded + 2 * scales);
    s->k_wide = s->q_wide + (size_t)heads * head_dim * 16;
    s->v_wide = s->k_wide + (size_t)KEYS * head_dim;
    return buffer;
}

int prefill_attention_avx512_supported(int num_q_heads, int num_kv_heads, int head_dim) {
    return (head_dim == 64 || head_dim == 128 || head_dim == 256) && num_kv_heads > 0 &&
           num_q_heads % num_kv_heads == 0;
}

/* Every item of a chunk reads the V rows of the steps below its causal limit, and each used to
 * pack them into pairs itself: every step once per item (per 16 query rows and head set), a
 * visible share of the kernel's time over a long prompt. Packed once per chunk instead, where
 * each step serves at least two items; not for the float32 form or 8-bit pools (their rows
 * are widened or decoded per item), nor beyond PACKED_LIMIT bytes (then per item, as before). */
#define PACKED_LIMIT ((int64_t)256 << 20)

static int64_t packed_units(const Chunk *c) {
    return ((c->context_len + KEYS - 1) / KEYS - c->packed_from) * c->num_kv_heads;
}

/* c->v_packed's steps, shared out among the team (every thread calls it; ends in a barrier).
 * s is not read: bf16 rows need no decoding. */
static void pack_chunk_values(const Chunk *c, uint32_t *v_packed, Scratch *s) {
    const int D = c->head_dim;
    const uint16_t *k_rows[KEYS], *v_rows[KEYS];
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < packed_units(c); unit++) {
        key_rows(c, (c->packed_from + unit / c->num_kv_heads) * KEYS,
                 (int)(unit % c->num_kv_heads), s, k_rows, v_rows, D, 0);
        pack_value_pairs(v_rows, v_packed + unit * (KEYS / 2) * D, D);
    }
}

/* Which form runs: -1 until first asked, then as timed (or as set for tests). */
static int form_in_use = -1;

/* 0: VDPBF16PS, 1: float32 FMA (choose_form's protocol, x86_common.h). */
int prefill_attention_avx512_form(int form) { return choose_form(&form_in_use, form); }

/* The chunk's items over `threads`; 0 when done, 1 when unsupported or out of memory. */
static int attend_chunk(Chunk c, int num_threads) {
    c.wide = prefill_attention_avx512_form(-2);
    const AttendItem attend = pick(c.head_dim, c.codes, c.wide);
    if (attend == NULL ||
        !prefill_attention_avx512_supported(c.num_q_heads, c.num_kv_heads, c.head_dim) ||
        c.q_len < 1 || c.q_len > c.context_len || c.window < 0)
        return 1;
    const int threads = num_threads < 1 ? 1 : num_threads;
    const int64_t row_blocks = (c.q_len + 15) / 16;
    c.heads_per_item = prefill_heads_per_item(c.num_q_heads / c.num_kv_heads, row_blocks * c.num_kv_heads,
                                      threads);
    const int parts = c.num_q_heads / c.heads_per_item; /* head sets across all kv heads */
    const int64_t items = row_blocks * parts;
    c.packed_from = prefill_window_first_step(c.context_len - c.q_len, c.window, KEYS); /* row 0's */
    const int64_t packed_bytes = packed_units(&c) * KEYS * c.head_dim * 2;
    uint32_t *v_packed = NULL;
    if (!c.wide && !c.codes && items >= 2 * (int64_t)c.num_kv_heads &&
        packed_bytes <= PACKED_LIMIT)
        v_packed = aligned_alloc(64, (size_t)packed_bytes); /* NULL: packed per item */
    int failed = 0; /* a thread without its scratch: rows left unwritten, so report it */
#pragma omp parallel num_threads(threads)
    {
        Scratch scratch;
        void *buffer = make_scratch(c.heads_per_item, c.head_dim, &scratch);
        if (buffer == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        Chunk mine = c; /* v_packed: read by the items once all of it is packed (a barrier) */
        if (v_packed != NULL) pack_chunk_values(&c, v_packed, &scratch);
        mine.v_packed = v_packed;
        /* the last query rows see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            if (buffer != NULL)
                attend(&mine, (int)(item % parts) * c.heads_per_item,
                       16 * (row_blocks - 1 - item / parts), &scratch);
        free(buffer);
    }
    free(v_packed);
    return failed;
}

/* Returns 0 when done, 1 when unsupported or out of memory (then use SDPA, which writes every
 * row of out again). */
int prefill_attention_avx512_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                  const uint16_t *v_cache, const int64_t *table,
                                  int64_t context_len, int64_t q_len, uint16_t *out,
                                  int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                                  float scale, int sliding_window, int num_threads) {
    const Chunk c = {.q = q, .k_cache = k_cache, .v_cache = v_cache, .table = table, .out = out,
                     .q_stride = q_stride, .context_len = context_len, .q_len = q_len,
                     .num_q_heads = num_q_heads, .num_kv_heads = num_kv_heads,
                     .head_dim = head_dim, .block_size = block_size, .scale = scale, .codes = 0,
                     .window = sliding_window};
    return attend_chunk(c, num_threads);
}

/* The same over an 8-bit pool: k_cache/v_cache codes [N, block_size, H_kv, D] (codes 1 int8,
 * 2 fp8 e4m3, 3 fp8 e5m2), k_scales/v_scales float32 [N, H_kv]. 0 when done, 1 when not. */
int prefill_attention_avx512_q8(const uint16_t *q, int64_t q_stride, const void *k_cache,
                                const void *v_cache, const float *k_scales, const float *v_scales,
                                int codes, const int64_t *table, int64_t context_len,
                                int64_t q_len, uint16_t *out, int num_q_heads, int num_kv_heads,
                                int head_dim, int block_size, float scale, int sliding_window,
                                int num_threads) {
    if (codes < 1 || codes > 3) return 1;
    const Chunk c = {.q = q, .k_cache = k_cache, .v_cache = v_cache, .k_scales = k_scales,
                     .v_scales = v_scales, .table = table, .out = out, .q_stride = q_stride,
                     .context_len = context_len, .q_len = q_len, .num_q_heads = num_q_heads,
                     .num_kv_heads = num_kv_heads, .head_dim = head_dim,
                     .block_size = block_size, .scale = scale, .codes = codes,
                     .window = sliding_window};
    return attend_chunk(c, num_threads);
}

#else /* no AVX-512 BF16 at build time: SDPA does it */

int prefill_attention_avx512_form(int form) { return 0; }

int prefill_attention_avx512_supported(int num_q_heads, int num_kv_heads, int head_dim) {
    return 0;
}
int prefill_attention_avx512_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                  const uint16_t *v_cache, const int64_t *table,
                                  int64_t context_len, int64_t q_len, uint16_t *out,
                                  int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                                  float scale, int sliding_window, int num_threads) {
    return 1;
}
int prefill_attention_avx512_q8(const uint16_t *q, int64_t q_stride, const void *k_cache,
                                const void *v_cache, const float *k_scales, const float *v_scales,
                                int codes, const int64_t *table, int64_t context_len,
                                int64_t q_len, uint16_t *out, int num_q_heads, int num_kv_heads,
                                int head_dim, int block_size, float scale, int sliding_window,
                                int num_threads) {
    return 1;
}

#endif
