/* Causal attention of one bf16 prefill chunk on x86 CPUs with AVX2 and FMA but no AVX-512 BF16,
 * flash-attention style: the path after the AMX and AVX-512 kernels. Without it such CPUs
 * gathered the sequence's blocks and ran torch's SDPA, which multiplies bf16 by emulation
 * there: the largest cost of long prompts and of prompts after a long cached prefix.
 *
 * The float32 form of prefill_attention_avx512.c with 8-lane vectors: a work item is one kv
 * head's group of query heads (or part of it, prefill_heads_per_item) for 16 query rows, two
 * vectors of one row per lane, walking the keys in steps of 6 up to its causal limit. Per step
 * the 6 K and V rows are widened to float32 once for all heads of the item (exact: bf16 is
 * float32's upper half); per head
 *   - S^T = K Q^T: lane r of s[k] = q_r . key k, per dim the two query vectors times the key's
 *     value broadcast: 12 FMAs for 8 loads, 12 independent chains,
 *   - the online softmax is lane-wise (row maxima and sums are vectors), exp as 2^x,
 *   - O^T[d] += P[k] x V[k][d] broadcast, 6 dims at a time: 12 FMAs for 8 loads again; O^T is
 *     rescaled only when a row's maximum grew.
 * The tiles are as large as the 16 ymm registers allow: a first form with one row vector per
 * broadcast (8 rows, 8 keys: a load per FMA) was bound by its loads, not its FMAs.
 * P stays float32 (no bf16 rounding of the weights), the output is rounded once to bf16.
 * Layouts: q rows q_stride elements apart, heads and head_dim contiguous (a view of the fused
 * QKV output); K/V cache [N, block_size, H_kv, D]; out contiguous [q_len, H_q, D].
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefill_items.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "x86_common.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define ROWS 16 /* query rows per item: two vectors of 8 lanes */
#define KEYS 6  /* keys per step: 6 x 2 score vectors, 12 FMA chains in the 16 registers */
#define DIMS 6  /* dims per pass of P V: 6 x 2 accumulators, 2 weight vectors, a broadcast */
#define MAX_DIM 256

typedef struct {
    const uint16_t *q, *k_cache, *v_cache;
    const int64_t *table;
    uint16_t *out;
    int64_t q_stride, context_len, q_len;
    int num_q_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int window;         /* > 0: row at p sees keys in (p - window, p]; 0: keys 0..p */
    int heads_per_item; /* a divisor of the group (query heads per kv head) */
} Chunk;

/* Score or weight vectors of a step: [key][half], lane r of half v = row 8 v + r. */
typedef __m256 StepVectors[KEYS][2];

/* One thread's state for a work item of heads_per_item query heads. */
typedef struct {
    float *out;        /* [heads][head_dim][ROWS]: O^T, unnormalised */
    float *q;          /* [heads][head_dim][ROWS]: query rows in lanes */
    __m256 *max, *sum; /* [heads][2]: raw-score maxima and sums of p per row */
    float *k_wide, *v_wide; /* [KEYS][head_dim]: the step's rows, widened */
    float *weights;    /* [KEYS][ROWS]: the step's softmax weights of one head */
} Scratch;

static const uint16_t zero_row[MAX_DIM]; /* the rows past the context (masked anyway) */

/* The K and V rows of keys key0 .. key0 + KEYS - 1 of kv head `kv`, widened into the scratch
 * (block and offset stepped along, no division per key). */
ALWAYS_INLINE void widen_step(const Chunk *c, int64_t key0, int kv, const Scratch *s, int D) {
    int64_t block = key0 / c->block_size, offset = key0 % c->block_size;
    for (int k = 0; k < KEYS; k++) {
        const uint16_t *k_row = zero_row, *v_row = zero_row;
        if (key0 + k < c->context_len) {
            const int64_t slot = c->table[block] * c->block_size + offset;
            const int64_t at = (slot * c->num_kv_heads + kv) * D;
            k_row = c->k_cache + at;
            v_row = c->v_cache + at;
        }
        for (int d = 0; d < D; d += 8) {
            _mm256_storeu_ps(s->k_wide + k * D + d, bf16x8_to_f32(k_row + d));
            _mm256_storeu_ps(s->v_wide + k * D + d, bf16x8_to_f32(v_row + d));
        }
        if (++offset == c->block_size) {
            offset = 0;
            block++;
        }
    }
}

/* The rows of the item's query heads as float32, one dim per 16 lanes (zero past q_len). */
static void pack_queries(const Chunk *c, int first_head, int64_t row0, int64_t rows, Scratch *s) {
    const int D = c->head_dim;
    for (int h = 0; h < c->heads_per_item; h++) {
        float *dst = s->q + (int64_t)h * D * ROWS;
        const int head = first_head + h;
        for (int r = 0; r < ROWS; r++) {
            const uint16_t *src = c->q + (row0 + r) * c->q_stride + (int64_t)head * D;
            for (int d = 0; d < D; d++) {
                const uint32_t bits = r < rows ? (uint32_t)src[d] << 16 : 0;
                memcpy(dst + d * ROWS + r, &bits, 4);
            }
        }
    }
}

/* lane r of s[k][v] = q_(8v + r) . key k: per dim two query vectors and a broadcast per key,
 * 12 FMAs for 8 loads. */
ALWAYS_INLINE void scores(const float *q, const float *k_wide, StepVectors s, int D) {
    __m256 acc[KEYS][2]; /* local: stores to `s` inside the loop would not be kept in registers */
    for (int k = 0; k < KEYS; k++) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        const __m256 q0 = _mm256_loadu_ps(q + ROWS * d), q1 = _mm256_loadu_ps(q + ROWS * d + 8);
#pragma GCC unroll 6
        for (int k = 0; k < KEYS; k++) {
            const __m256 key = _mm256_broadcast_ss(k_wide + k * D + d);
            acc[k][0] = _mm256_fmadd_ps(q0, key, acc[k][0]);
            acc[k][1] = _mm256_fmadd_ps(q1, key, acc[k][1]);
        }
    }
    for (int k = 0; k < KEYS; k++) s[k][0] = acc[k][0], s[k][1] = acc[k][1];
}

/* The online softmax of one head over the step's scores (lane = query row), into `weights`
 * ([KEYS][ROWS]): key k's weight exp((s - max) * scale), 0 where the row does not see the key;
 * max[2] and sum[2] move on. alpha[2]: the factors O^T must be multiplied by; returns 0 when no
 * row's maximum grew (factors 1: the multiply is skipped). */
ALWAYS_INLINE int softmax_step(StepVectors s, int64_t key0, int64_t first_pos, int window,
                               float scale, __m256 *max, __m256 *sum, __m256 *alpha,
                               float *weights) {
    /* key key0 + k is seen by row r when key0 + k <= first_pos + r, and with a window when
     * also key0 + k > first_pos + r - window. A row may see none of the keys: its maximum
     * stays, its weights are 0. */
    const int masked = key0 + KEYS - 1 > first_pos || window > 0;
    const __m256 factor = _mm256_set1_ps(scale * 1.44269504088896341f);
    int rescale = 0;
    for (int v = 0; v < 2; v++) {
        const __m256i rows = _mm256_setr_epi32(8 * v, 8 * v + 1, 8 * v + 2, 8 * v + 3, 8 * v + 4,
                                               8 * v + 5, 8 * v + 6, 8 * v + 7);
        __m256 keep[KEYS], m = max[v];
        for (int k = 0; k < KEYS; k++) {
            const int distance = (int)(key0 + k - first_pos); /* key minus row 0's position */
            __m256i seen = masked ? _mm256_cmpgt_epi32(rows, _mm256_set1_epi32(distance - 1))
                                  : _mm256_set1_epi32(-1);
            if (window > 0)
                seen = _mm256_and_si256(
                    seen, _mm256_cmpgt_epi32(_mm256_set1_epi32(distance + window), rows));
            keep[k] = _mm256_castsi256_ps(seen);
            m = _mm256_blendv_ps(m, _mm256_max_ps(m, s[k][v]), keep[k]);
        }
        /* exp((s - m) scale) = 2^(s f - m f), f = scale log2(e): one FMA per vector */
        const __m256 shift = _mm256_mul_ps(m, factor);
        const int grew = _mm256_movemask_ps(_mm256_cmp_ps(m, max[v], _CMP_NEQ_OQ)) != 0;
        alpha[v] = grew ? exp2_8_nonpositive(_mm256_fmsub_ps(max[v], factor, shift))
                        : _mm256_set1_ps(1.0f);
        rescale |= grew;
        max[v] = m;
        __m256 step_sum = _mm256_setzero_ps();
        for (int k = 0; k < KEYS; k++) {
            const __m256 x = _mm256_fmsub_ps(s[k][v], factor, shift);
            const __m256 e = _mm256_and_ps(keep[k], exp2_8_nonpositive(x));
            _mm256_storeu_ps(weights + k * ROWS + 8 * v, e);
            step_sum = _mm256_add_ps(step_sum, e);
        }
        sum[v] = _mm256_fmadd_ps(sum[v], alpha[v], step_sum);
    }
    return rescale;
}

/* O^T[d0 .. d0 + N) = O^T x alpha + P V for N (<= DIMS) dims: per key its two weight vectors
 * and a broadcast of V's value per dim, 2 N FMAs for N + 2 loads. */
ALWAYS_INLINE void values_dims(const float *weights, const float *v_wide, const __m256 *alpha,
                               int rescale, float *out, int d0, int N, int D) {
    __m256 acc[DIMS][2];
    for (int j = 0; j < N; j++)
        for (int v = 0; v < 2; v++) {
            acc[j][v] = _mm256_loadu_ps(out + (d0 + j) * ROWS + 8 * v);
            if (rescale) acc[j][v] = _mm256_mul_ps(acc[j][v], alpha[v]);
        }
    for (int k = 0; k < KEYS; k++) {
        const __m256 p0 = _mm256_loadu_ps(weights + k * ROWS);
        const __m256 p1 = _mm256_loadu_ps(weights + k * ROWS + 8);
#pragma GCC unroll 6
        for (int j = 0; j < N; j++) {
            const __m256 value = _mm256_broadcast_ss(v_wide + k * D + d0 + j);
            acc[j][0] = _mm256_fmadd_ps(p0, value, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(p1, value, acc[j][1]);
        }
    }
    for (int j = 0; j < N; j++)
        for (int v = 0; v < 2; v++) _mm256_storeu_ps(out + (d0 + j) * ROWS + 8 * v, acc[j][v]);
}

ALWAYS_INLINE void values(const float *weights, const float *v_wide, const __m256 *alpha,
                          int rescale, float *out, int D) {
    int d0 = 0;
    for (; d0 + DIMS <= D; d0 += DIMS)
        values_dims(weights, v_wide, alpha, rescale, out, d0, DIMS, D);
    if (D % DIMS) values_dims(weights, v_wide, alpha, rescale, out, d0, D % DIMS, D);
}

/* O^T / sum of one head -> its rows of out, rounded to bf16. */
static void write_rows(const Chunk *c, int head, int64_t row0, int64_t rows, const float *out,
                       const __m256 *sum) {
    float row[ROWS][MAX_DIM], inv[ROWS];
    for (int v = 0; v < 2; v++)
        _mm256_storeu_ps(inv + 8 * v, _mm256_div_ps(_mm256_set1_ps(1.0f), sum[v]));
    for (int d = 0; d < c->head_dim; d++)
        for (int r = 0; r < ROWS; r++) row[r][d] = out[d * ROWS + r] * inv[r];
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = c->out + ((row0 + r) * c->num_q_heads + head) * c->head_dim;
        for (int d = 0; d < c->head_dim; d += 16)
            bf16x16_store_rounded(dst + d, bf16x8_round(_mm256_loadu_ps(row[r] + d)),
                                  bf16x8_round(_mm256_loadu_ps(row[r] + d + 8)));
    }
}

/* ROWS query rows (from `row0`) of query heads first_head .. + heads_per_item (one kv head's). */
ALWAYS_INLINE void attend_item(const Chunk *c, int first_head, int64_t row0, Scratch *s, int D) {
    const int heads = c->heads_per_item, kv = first_head / (c->num_q_heads / c->num_kv_heads);
    const int64_t rows = c->q_len - row0 < ROWS ? c->q_len - row0 : ROWS;
    const int64_t first_pos = c->context_len - c->q_len + row0;
    const int64_t last_key = first_pos + rows - 1; /* causal limit of the item's last row */
    pack_queries(c, first_head, row0, rows, s);
    memset(s->out, 0, sizeof(float) * heads * D * ROWS);
    for (int i = 0; i < 2 * heads; i++) {
        /* replaced by each row's first seen key; finite, so that max x factor stays finite */
        s->max[i] = _mm256_set1_ps(-1e30f);
        s->sum[i] = _mm256_setzero_ps();
    }
    /* nothing before row 0's window is read (from its step's start: the keys before the
     * window are masked) */
    const int64_t first_key = prefill_window_first_step(first_pos, c->window, KEYS) * KEYS;
    for (int64_t key0 = first_key; key0 <= last_key; key0 += KEYS) {
        widen_step(c, key0, kv, s, D);
        for (int h = 0; h < heads; h++) {
            StepVectors scored;
            __m256 alpha[2];
            scores(s->q + (int64_t)h * D * ROWS, s->k_wide, scored, D);
            const int rescale = softmax_step(scored, key0, first_pos, c->window, c->scale,
                                             s->max + 2 * h, s->sum + 2 * h, alpha, s->weights);
            values(s->weights, s->v_wide, alpha, rescale, s->out + (int64_t)h * D * ROWS, D);
        }
    }
    for (int h = 0; h < heads; h++)
        write_rows(c, first_head + h, row0, rows, s->out + (int64_t)h * D * ROWS, s->sum + 2 * h);
}

typedef void (*AttendItem)(const Chunk *, int, int64_t, Scratch *);

#define SPECIALISE(DIM)                                                                      \
    static void attend_item_##DIM(const Chunk *c, int first_head, int64_t row0, Scratch *s) { \
        attend_item(c, first_head, row0, s, DIM);                                            \
    }
SPECIALISE(64)
SPECIALISE(128)
SPECIALISE(256)

static AttendItem pick(int head_dim) {
    return head_dim == 64 ? attend_item_64 : head_dim == 128 ? attend_item_128
         : head_dim == 256 ? attend_item_256 : NULL;
}

/* One allocation per thread; returns it (to free), NULL when out of memory. */
static void *make_scratch(int heads, int head_dim, Scratch *s) {
    const size_t lanes = (size_t)heads * head_dim * ROWS, rows = (size_t)KEYS * head_dim;
    const size_t stats = (size_t)4 * heads * 8, weights = (size_t)KEYS * ROWS;
    float *buffer = aligned_alloc(32, sizeof(float) * (stats + 2 * lanes + 2 * rows + weights));
    if (buffer == NULL) return NULL;
    s->max = (__m256 *)buffer; /* 32-byte aligned, first */
    s->sum = s->max + 2 * heads;
    s->out = buffer + stats;
    s->q = s->out + lanes;
    s->k_wide = s->q + lanes;
    s->v_wide = s->k_wide + rows;
    s->weights = s->v_wide + rows;
    return buffer;
}

int prefill_attention_avx2_supported(int num_q_heads, int num_kv_heads, int head_dim) {
    return pick(head_dim) != NULL && num_kv_heads > 0 && num_q_heads % num_kv_heads == 0;
}

/* Returns 0 when done, 1 when unsupported or out of memory (then use SDPA, which writes every
 * row of out again). */
int prefill_attention_avx2_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int64_t *table,
                                int64_t context_len, int64_t q_len, uint16_t *out,
                                int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                                float scale, int sliding_window, int num_threads) {
    if (!prefill_attention_avx2_supported(num_q_heads, num_kv_heads, head_dim) || q_len < 1 ||
        q_len > context_len || sliding_window < 0)
        return 1;
    const int threads = num_threads < 1 ? 1 : num_threads;
    const int64_t row_blocks = (q_len + ROWS - 1) / ROWS;
    const int heads = prefill_heads_per_item(num_q_heads / num_kv_heads, row_blocks * num_kv_heads,
                                             threads);
    const Chunk c = {.q = q, .k_cache = k_cache, .v_cache = v_cache, .table = table, .out = out,
                     .q_stride = q_stride, .context_len = context_len, .q_len = q_len,
                     .num_q_heads = num_q_heads, .num_kv_heads = num_kv_heads,
                     .head_dim = head_dim, .block_size = block_size, .scale = scale,
                     .window = sliding_window, .heads_per_item = heads};
    const AttendItem attend = pick(head_dim);
    const int parts = num_q_heads / heads; /* head sets across all kv heads */
    const int64_t items = row_blocks * parts;
    int failed = 0; /* a thread without its scratch: rows left unwritten, so report it */
#pragma omp parallel num_threads(threads)
    {
        Scratch scratch;
        void *buffer = make_scratch(heads, head_dim, &scratch);
        if (buffer == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* the last query rows see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            if (buffer != NULL)
                attend(&c, (int)(item % parts) * heads, ROWS * (row_blocks - 1 - item / parts),
                       &scratch);
        free(buffer);
    }
    return failed;
}

#else /* no AVX2 and FMA at build time: SDPA does it */

int prefill_attention_avx2_supported(int num_q_heads, int num_kv_heads, int head_dim) {
    (void)num_q_heads, (void)num_kv_heads, (void)head_dim;
    return 0;
}
int prefill_attention_avx2_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int64_t *table,
                                int64_t context_len, int64_t q_len, uint16_t *out,
                                int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                                float scale, int sliding_window, int num_threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)table, (void)context_len;
    (void)q_len, (void)out, (void)num_q_heads, (void)num_kv_heads, (void)head_dim;
    (void)block_size, (void)scale, (void)sliding_window, (void)num_threads;
    return 1;
}

#endif
