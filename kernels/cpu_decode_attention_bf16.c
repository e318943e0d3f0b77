/* Paged decode attention for bfloat16 with AVX-512 BF16 intrinsics: the fast path that
 * cpu_decode_attention.c tries first (it keeps the portable loop for everything else).
 *
 * Why a second kernel: on this CPU's 480 MB L3 the KV of a decode step is mostly cache
 * resident, so the portable kernel was bound by instructions, not memory: every K row was
 * widened to float32 through a stack buffer and every q.k dot ended in a horizontal sum
 * (~8 shuffles and adds per score). Here
 *   - q.k runs on bf16 pairs straight from the cache with VDPBF16PS (float32 accumulation),
 *   - 16 scores are summed at once by a transpose-add tree (sum16: ~3 ops per score),
 *   - the V pass keeps the output accumulators of one kv head's query heads in registers,
 *   - a work item is one sequence, its kv heads in turn: the first head's pass pulls whole
 *     blocks into L2 and the other heads find them there ((sequence, kv head) items measured
 *     ~5% slower in a full decode step).
 * Layouts are those of cpu_decode_attention.c; only the query may have a row stride (it is a
 * view of the fused QKV output, and copying it out would cost a pass over memory).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_decode_shapes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define CHUNK 16 /* scores summed per transpose-add tree: one per float32 lane */
#define MAX_GROUP 8 /* query heads per kv head (specialisations below) */
#define MAX_VECS 8  /* float32 vectors per head row: head_dim 128 */

typedef struct {
    const uint16_t *q, *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    uint16_t *out;
    int64_t q_stride, max_blocks;
    int num_q_heads, num_kv_heads, block_size;
    float scale;
} Bf16Job;

/* Lane t of the result = sum of the 16 lanes of v[t]. */
ALWAYS_INLINE __m512 sum16(const __m512 v[CHUNK]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: [a, b, c, d] lane partial sums */
        __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

ALWAYS_INLINE __m512 bf16x16_to_f32(const uint16_t *src) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* Row of token 0 of logical block `index`, kv head `kv`; the block's tokens follow at a stride
 * of num_kv_heads * DIM elements. */
ALWAYS_INLINE const uint16_t *head_rows(const Bf16Job *job, const uint16_t *cache,
                                        const int64_t *table, int64_t index, int kv, int DIM) {
    return cache + (table[index] * job->block_size * job->num_kv_heads + kv) * DIM;
}

#ifndef PREFETCH_DISTANCE
#define PREFETCH_DISTANCE 1 /* blocks ahead */
#endif

/* Blocks are scattered, so the hardware prefetchers stop at every block boundary: fetch this
 * kv head's rows of the block PREFETCH_DISTANCE ahead while the current one is computed. */
ALWAYS_INLINE void prefetch_block_ahead(const Bf16Job *job, const uint16_t *cache,
                                        const int64_t *table, int64_t start, int64_t len, int kv,
                                        int DIM) {
    const int bs = job->block_size;
    const int64_t ahead = start + (int64_t)PREFETCH_DISTANCE * bs;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM;
    if (ahead >= len) return;
    const uint16_t *rows = head_rows(job, cache, table, ahead / bs, kv, DIM);
    int count = len - ahead < bs ? (int)(len - ahead) : bs;
    for (int t = 0; t < count; t++)
        for (int byte = 0; byte < DIM * 2; byte += 64)
            _mm_prefetch((const char *)(rows + t * stride) + byte, _MM_HINT_T0);
}

/* Lane t: q . row t, for the first n of 16 rows `stride` elements apart (lanes >= n: 0). */
ALWAYS_INLINE __m512 dot_chunk(const uint16_t *rows, int n, int64_t stride, const __m512bh *q,
                               int NV) {
    __m512 dots[CHUNK];
    for (int t = 0; t < CHUNK; t++) {
        __m512 acc = _mm512_setzero_ps();
        if (t < n)
            for (int i = 0; i < NV; i++)
                acc = _mm512_dpbf16_ps(acc, q[i],
                                       (__m512bh)_mm512_loadu_si512(rows + t * stride + 32 * i));
        dots[t] = acc;
    }
    return sum16(dots);
}

/* Scores of one kv head's GROUP query heads against all `len` keys, scaled, into
 * scores[g * len + t]; returns each head's maximum in max_score[g]. */
ALWAYS_INLINE void score_keys(const Bf16Job *job, const int64_t *table, int64_t len, int kv,
                              const __m512bh q[][4], float *scores, float *max_score, int DIM,
                              int GROUP) {
    const int bs = job->block_size, NV = DIM / 32;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM; /* elements between tokens */
    const __m512 scale = _mm512_set1_ps(job->scale);
    __m512 top[MAX_GROUP]; /* fixed sizes: after unrolling they live in registers */
    for (int g = 0; g < GROUP; g++) top[g] = _mm512_set1_ps(-FLT_MAX);
    for (int64_t start = 0; start < len; start += bs) {
        const uint16_t *rows = head_rows(job, job->k_cache, table, start / bs, kv, DIM);
        int count = len - start < bs ? (int)(len - start) : bs;
        prefetch_block_ahead(job, job->k_cache, table, start, len, kv, DIM);
        for (int c = 0; c < count; c += CHUNK) {
            int n = count - c < CHUNK ? count - c : CHUNK;
            __mmask16 valid = (__mmask16)((1u << n) - 1u);
            const uint16_t *chunk = rows + (int64_t)c * stride;
            for (int g = 0; g < GROUP; g++) {
                /* Two copies of the loop so that the full chunks (nearly all) have no branch. */
                __m512 s = n == CHUNK ? dot_chunk(chunk, CHUNK, stride, q[g], NV)
                                      : dot_chunk(chunk, n, stride, q[g], NV);
                s = _mm512_mul_ps(s, scale);
                _mm512_mask_storeu_ps(scores + g * len + start + c, valid, s);
                top[g] = _mm512_mask_max_ps(top[g], valid, top[g], s);
            }
        }
    }
    for (int g = 0; g < GROUP; g++) max_score[g] = _mm512_reduce_max_ps(top[g]);
}

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2,
 * p the degree-6 Taylor polynomial (relative error ~1e-7). Written out because libm's scalar
 * expf, which the compiler called here for most of the lanes, cost more than the dot products. */
ALWAYS_INLINE __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f)); /* below: 0 after scaling anyway */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln2, split in two */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* scores[g] <- exp(scores[g] - max); returns 1 / sum per head in inv_sum[g]. */
ALWAYS_INLINE void softmax_rows(float *scores, int64_t len, const float *max_score,
                                float *inv_sum, int GROUP) {
    for (int g = 0; g < GROUP; g++) {
        float *row = scores + g * len;
        __m512 top = _mm512_set1_ps(max_score[g]), sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += CHUNK) {
            __mmask16 valid = len - t >= CHUNK ? 0xffff : (__mmask16)((1u << (len - t)) - 1u);
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, row + t), top));
            _mm512_mask_storeu_ps(row + t, valid, e);
            sum = _mm512_mask_add_ps(sum, valid, sum, e);
        }
        inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
}

/* out rows of the GROUP query heads = sum_t p[g][t] * V[t] / sum[g], rounded to bf16. */
ALWAYS_INLINE void weigh_values(const Bf16Job *job, const int64_t *table, int64_t len, int kv,
                                const float *probs, const float *inv_sum, uint16_t *out, int DIM,
                                int GROUP) {
    const int bs = job->block_size, NF = DIM / 16;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM;
    __m512 acc[MAX_GROUP][MAX_VECS];
    for (int g = 0; g < GROUP; g++)
        for (int j = 0; j < NF; j++) acc[g][j] = _mm512_setzero_ps();
    for (int64_t start = 0; start < len; start += bs) {
        const uint16_t *rows = head_rows(job, job->v_cache, table, start / bs, kv, DIM);
        int count = len - start < bs ? (int)(len - start) : bs;
        prefetch_block_ahead(job, job->v_cache, table, start, len, kv, DIM);
        for (int t = 0; t < count; t++) {
            const uint16_t *row = rows + (int64_t)t * stride;
            __m512 value[MAX_VECS];
            for (int j = 0; j < NF; j++) value[j] = bf16x16_to_f32(row + 16 * j);
            for (int g = 0; g < GROUP; g++) {
                __m512 p = _mm512_set1_ps(probs[g * len + start + t]);
                for (int j = 0; j < NF; j++) acc[g][j] = _mm512_fmadd_ps(p, value[j], acc[g][j]);
            }
        }
    }
    for (int g = 0; g < GROUP; g++) {
        __m512 inv = _mm512_set1_ps(inv_sum[g]);
        for (int j = 0; j < NF; j++)
            _mm256_storeu_si256((__m256i *)(out + g * DIM + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][j], inv)));
    }
}

ALWAYS_INLINE void attend_head_group(const Bf16Job *job, int seq, int kv, float *scores, int DIM,
                                     int GROUP) {
    const int64_t len = job->seq_lens[seq];
    const int64_t *table = job->block_tables + (int64_t)seq * job->max_blocks;
    const int first_head = kv * GROUP;
    __m512bh q[MAX_GROUP][4];
    for (int g = 0; g < GROUP; g++)
        for (int i = 0; i < DIM / 32; i++)
            q[g][i] = (__m512bh)_mm512_loadu_si512(job->q + seq * job->q_stride +
                                                   (int64_t)(first_head + g) * DIM + 32 * i);
    float max_score[MAX_GROUP], inv_sum[MAX_GROUP];
    score_keys(job, table, len, kv, q, scores, max_score, DIM, GROUP);
    softmax_rows(scores, len, max_score, inv_sum, GROUP);
    uint16_t *out = job->out + ((int64_t)seq * job->num_q_heads + first_head) * DIM;
    weigh_values(job, table, len, kv, scores, inv_sum, out, DIM, GROUP);
}

#define SPECIALISE(DIM, GROUP)                                                              \
    static void attend_##DIM##_##GROUP(const Bf16Job *job, int seq, int kv, float *scores) { \
        attend_head_group(job, seq, kv, scores, DIM, GROUP);                               \
    }
DECODE_SHAPES(SPECIALISE)

typedef void (*AttendFn)(const Bf16Job *, int, int, float *);

static AttendFn pick(int dim, int group) {
#define CASE(DIM, GROUP) if (dim == DIM && group == GROUP) return attend_##DIM##_##GROUP;
    DECODE_SHAPES(CASE)
#undef CASE
    return NULL;
}

int paged_decode_attention_bf16(const void *q, int64_t q_stride, const void *k_cache,
                                const void *v_cache, const int64_t *block_tables,
                                int64_t max_blocks, const int64_t *seq_lens, void *out,
                                int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                int block_size, float scale, int num_threads) {
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return 1;
    int group = num_q_heads / num_kv_heads;
    AttendFn attend = pick(head_dim, group);
    if (attend == NULL) return 1;
    int64_t longest = 1;
    for (int s = 0; s < num_seqs; s++)
        if (seq_lens[s] > longest) longest = seq_lens[s];
    Bf16Job job = {q, k_cache, v_cache, block_tables, seq_lens, out, q_stride, max_blocks,
                   num_q_heads, num_kv_heads, block_size, scale};
    const int items = num_seqs;
    int failed = 0;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)longest);
        int ok = scores != NULL;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++)
            for (int kv = 0; ok && kv < num_kv_heads; kv++) attend(&job, item, kv, scores);
        failed |= !ok;
        free(scores);
    }
    return failed;
}

#else /* no AVX-512 BF16 on the build machine: the portable kernel does everything */

int paged_decode_attention_bf16(const void *q, int64_t q_stride, const void *k_cache,
                                const void *v_cache, const int64_t *block_tables,
                                int64_t max_blocks, const int64_t *seq_lens, void *out,
                                int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                int block_size, float scale, int num_threads) {
    return 1;
}

#endif
