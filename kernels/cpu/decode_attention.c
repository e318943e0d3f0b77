/* Paged decode attention for the CPU: one query token per sequence, K/V read in place
 * through the block table (no gather into a contiguous copy), float32 accumulation.
 *
 * Built on first use by pagedgen/kernels/cpu/native.py with the system C compiler
 * (-O3 -march=native) and called through ctypes, which releases the GIL. Why C and not
 * torch: the torch path gathers every sequence's blocks into a padded copy and then runs
 * SDPA over it, reading and writing the KV bytes about three times; decode attention is
 * memory-bound, so reading each K and V byte once is what makes it fast.
 *
 * Layout (docs/contracts.md section 1): one layer's K (or V) cache is [N, B, H_kv, D],
 * contiguous; the query is [S, H_q, D] with heads contiguous and q_stride elements between
 * sequences; the output is contiguous [S, H_q, D]; block tables are int64 [S, max_blocks].
 * bfloat16 goes to the AVX-512 BF16 kernel (decode_attention_bf16.c) where the build
 * machine has it, else to the AVX2 one (decode_attention_avx2.c); this portable loop serves
 * float32, other CPUs and other head sizes.
 * Work is split over sequences across threads; each K/V row is loaded once for all the
 * H_q / H_kv query heads that share its kv head (GQA).
 * 8-bit pools (int8, fp8 e4m3/e5m2 codes with one float32 scale per block and kv head) are
 * read here too, at one byte per element: codes are decoded to float32 with integer and
 * float arithmetic the compiler vectorises (no lookup table), the K scale multiplies the dot
 * product and the V scale the softmax weight, so each row costs no extra multiply per element.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_shapes.h"
#include "team_ops.h"

#define MAX_GROUP 16  /* query heads per kv head */
#define MAX_HEADS 128 /* query heads */
#define MAX_DIM 256   /* head dim */

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    void *out;
    int64_t max_blocks, q_stride;
    int num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, is_bf16;
    float scale;
    const float *k_scales, *v_scales;    /* [N, H_kv] of an 8-bit pool */
    int kv_codes;                        /* 0: K/V as the query; 1 int8, 2 e4m3, 3 e5m2 */
    int sliding_window;                  /* > 0: keys before len - window are not attended */
    float (*scratch_q)[MAX_DIM];         /* per thread: [num_q_heads][MAX_DIM] */
    float (*scratch_acc)[MAX_DIM];
} Job;

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void load_row(const void *base, int64_t index, int dim, int is_bf16, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + index * dim;
        uint32_t bits[MAX_DIM];
        for (int d = 0; d < dim; d++) bits[d] = (uint32_t)src[d] << 16;
        memcpy(dst, bits, sizeof(float) * dim);
    } else {
        memcpy(dst, (const float *)base + index * dim, sizeof(float) * dim);
    }
}

/* 2^n for -126 <= n <= 127, from its bits. */
ALWAYS_INLINE float pow2i(int n) {
    uint32_t bits = (uint32_t)(n + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The value of one 8-bit code (before its scale). fp8: sign, exponent, mantissa fields;
 * normal (2^M + m) * 2^(e - bias - M), subnormal (e = 0) m * 2^(1 - bias - M). Inf/NaN codes
 * never occur: the pool's writer clamps to the format's largest finite value. */
ALWAYS_INLINE float decode_code(uint8_t c, int kv_codes) {
    if (kv_codes == 1) return (float)(int8_t)c;
    const int mant_bits = kv_codes == 2 ? 3 : 2, bias = kv_codes == 2 ? 7 : 15;
    int e = (c & 0x7F) >> mant_bits, m = c & ((1 << mant_bits) - 1);
    float mag = (float)(e ? (1 << mant_bits) + m : m) * pow2i((e ? e : 1) - bias - mant_bits);
    return (c & 0x80) ? -mag : mag;
}

/* K or V row `index` of the cache: float32/bf16 values, or decoded 8-bit codes (unscaled). */
ALWAYS_INLINE void load_kv_row(const void *base, int64_t index, int dim, int is_bf16,
                               int kv_codes, float *dst) {
    if (!kv_codes) {
        load_row(base, index, dim, is_bf16, dst);
        return;
    }
    const uint8_t *src = (const uint8_t *)base + index * dim;
#pragma omp simd
    for (int d = 0; d < dim; d++) dst[d] = decode_code(src[d], kv_codes);
}

/* One sequence, all heads: scores of every query head against every key, softmax, sum of V.
 * A token's K (and V) rows of all kv heads are adjacent in memory, so walking tokens in order
 * and all heads per token streams each block's bytes sequentially (what the prefetchers
 * like): decode attention is bound by reading the cache from DRAM.
 * always_inline + constant dim/group/dtype at the call sites (dispatch below) lets the
 * compiler unroll and vectorize the inner loops for the common head sizes. */
ALWAYS_INLINE void attend_one(const Job *job, int seq, float *scores, int dim, int group,
                              int is_bf16, int kv_codes) {
    const int bs = job->block_size, hkv = job->num_kv_heads, hq = job->num_q_heads;
    const int64_t len = job->seq_lens[seq], first = window_first_key(len, job->sliding_window);
    const int64_t *table = job->block_tables + (int64_t)seq * job->max_blocks;
    float (*q)[MAX_DIM] = job->scratch_q, (*acc)[MAX_DIM] = job->scratch_acc;
    float row[MAX_DIM], max_score[MAX_HEADS], denom[MAX_HEADS];
    for (int h = 0; h < hq; h++) {
        load_row(job->q, (seq * job->q_stride) / dim + h, dim, is_bf16, q[h]);
        for (int d = 0; d < dim; d++) q[h][d] *= job->scale;
        memset(acc[h], 0, sizeof(float) * dim);
        max_score[h] = -FLT_MAX;
    }
    /* keys from `first` on; scores[h * len + t] before it stay unused */
    for (int64_t start = first / bs * bs; start < len; start += bs) { /* pass 1: K once, in order */
        int64_t block = table[start / bs], base = block * bs * hkv;
        int64_t count = len - start < bs ? len - start : bs;
        for (int64_t o = start < first ? first - start : 0; o < count; o++) {
            for (int kv = 0; kv < hkv; kv++) {
                load_kv_row(job->k_cache, base + o * hkv + kv, dim, is_bf16, kv_codes, row);
                float row_scale = kv_codes ? job->k_scales[block * hkv + kv] : 1.0f;
                for (int g = 0; g < group; g++) {
                    int h = kv * group + g;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < dim; d++) dot += q[h][d] * row[d];
                    dot *= row_scale;
                    scores[h * len + start + o] = dot;
                    max_score[h] = dot > max_score[h] ? dot : max_score[h];
                }
            }
        }
    }
    for (int h = 0; h < hq; h++) {
        float sum = 0.0f, *row_scores = scores + h * len, top = max_score[h];
#pragma omp simd reduction(+ : sum)
        for (int64_t t = first; t < len; t++) {
            row_scores[t] = expf(row_scores[t] - top);
            sum += row_scores[t];
        }
        denom[h] = sum;
    }
    for (int64_t start = first / bs * bs; start < len; start += bs) { /* pass 2: V, in order */
        int64_t block = table[start / bs], base = block * bs * hkv;
        int64_t count = len - start < bs ? len - start : bs;
        for (int64_t o = start < first ? first - start : 0; o < count; o++) {
            for (int kv = 0; kv < hkv; kv++) {
                load_kv_row(job->v_cache, base + o * hkv + kv, dim, is_bf16, kv_codes, row);
                float row_scale = kv_codes ? job->v_scales[block * hkv + kv] : 1.0f;
                for (int g = 0; g < group; g++) {
                    int h = kv * group + g;
                    float p = scores[h * len + start + o] * row_scale;
#pragma omp simd
                    for (int d = 0; d < dim; d++) acc[h][d] += p * row[d];
                }
            }
        }
    }
    for (int h = 0; h < hq; h++) {
        int64_t out_row = ((int64_t)seq * hq + h) * dim;
        float inv = 1.0f / denom[h];
        for (int d = 0; d < dim; d++) {
            float value = acc[h][d] * inv;
            if (is_bf16)
                ((uint16_t *)job->out)[out_row + d] = f32_to_bf16(value);
            else
                ((float *)job->out)[out_row + d] = value;
        }
    }
}

/* The query/output dtype and the K/V encoding as constants of each instance. */
#define ATTEND_ALL_KINDS(job, seq, scores, dim, group)                                       \
    switch ((job)->kv_codes) {                                                              \
    case 1: attend_one(job, seq, scores, dim, group, (job)->is_bf16, 1); break;             \
    case 2: attend_one(job, seq, scores, dim, group, (job)->is_bf16, 2); break;             \
    case 3: attend_one(job, seq, scores, dim, group, (job)->is_bf16, 3); break;             \
    default:                                                                                \
        if ((job)->is_bf16) attend_one(job, seq, scores, dim, group, 1, 0);                 \
        else attend_one(job, seq, scores, dim, group, 0, 0);                                \
    }

#define SPECIALISE(DIM, GROUP)                                                               \
    static void attend_##DIM##_##GROUP(const Job *job, int seq, float *scores) {             \
        ATTEND_ALL_KINDS(job, seq, scores, DIM, GROUP)                                       \
    }
DECODE_SHAPES(SPECIALISE)

static void attend_generic(const Job *job, int seq, float *scores) {
    int group = job->num_q_heads / job->num_kv_heads;
    ATTEND_ALL_KINDS(job, seq, scores, job->head_dim, group)
}

typedef void (*AttendFn)(const Job *, int, float *);

static AttendFn pick_attend(int dim, int group) {
    DECODE_SHAPES(DECODE_PICK_CASE)
    return attend_generic;
}

int decode_attention_supported(const DecodeAttention *a) {
    if (a->num_kv_heads <= 0 || a->num_q_heads % a->num_kv_heads != 0) return 0;
    if (a->num_q_heads / a->num_kv_heads > MAX_GROUP || a->num_q_heads > MAX_HEADS) return 0;
    if (a->kv_codes < 0 || a->kv_codes > 3 || (a->kv_codes && !(a->k_scales && a->v_scales)))
        return 0;
    return a->head_dim <= MAX_DIM && a->q_stride % a->head_dim == 0 && a->sliding_window >= 0;
}

/* The AVX-512 BF16 kernel (bf16 pools) or the AVX-512 8-bit one where they apply, then the
 * AVX2 one (bf16 pools), else the portable loop. */
void decode_attention_team(const DecodeAttention *a, int *failed) {
    const int choice = decode_attention_kernel(-2), avx512 = choice == 0, avx2 = choice <= 1;
    if (avx512 && !a->kv_codes && decode_attention_bf16_supported(a)) {
        decode_attention_bf16_team(a, failed);
        return;
    }
    if (avx512 && a->kv_codes && decode_attention_q8_avx512_supported(a)) {
        decode_attention_q8_avx512_team(a, failed);
        return;
    }
    if (avx2 && decode_attention_avx2_supported(a)) {
        decode_attention_avx2_team(a, failed);
        return;
    }
    int64_t longest = 1;
    for (int s = 0; s < a->num_seqs; s++)
        if (a->seq_lens[s] > longest) longest = a->seq_lens[s];
    AttendFn attend = pick_attend(a->head_dim, a->num_q_heads / a->num_kv_heads);
    Job job = {a->q, a->k_cache, a->v_cache, a->block_tables, a->seq_lens, a->out,
               a->max_blocks, a->q_stride, a->num_seqs, a->num_q_heads, a->num_kv_heads,
               a->head_dim, a->block_size, a->is_bf16, a->scale, a->k_scales, a->v_scales,
               a->kv_codes, a->sliding_window,
               malloc(sizeof(float) * MAX_DIM * (size_t)a->num_q_heads),
               malloc(sizeof(float) * MAX_DIM * (size_t)a->num_q_heads)};
    float *scores = malloc(sizeof(float) * (size_t)a->num_q_heads * (size_t)longest);
    int ok = scores && job.scratch_q && job.scratch_acc;
    if (!ok) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int seq = 0; seq < a->num_seqs; seq++)
        if (ok) attend(&job, seq, scores);
    free(scores);
    free(job.scratch_q);
    free(job.scratch_acc);
}

/* Returns 0 on success, 1 on unsupported shapes or allocation failure (caller falls back).
 * Threads: OpenMP. torch loads its libgomp.so.1 before this library, so the dynamic loader
 * binds us to that same runtime and we share torch's thread pool. (A second pool, or
 * pthreads of our own, fought torch's spinning workers for the cores: many times slower.) */
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, int64_t max_blocks,
                           const int64_t *seq_lens, void *out, int num_seqs, int num_q_heads,
                           int num_kv_heads, int head_dim, int block_size, float scale,
                           int is_bf16, int sliding_window, int share_blocks,
                           int num_threads) {
    const DecodeAttention args = {q, k_cache, v_cache, block_tables, seq_lens, out, q_stride,
                                  max_blocks, num_seqs, num_q_heads, num_kv_heads, head_dim,
                                  block_size, is_bf16, scale, NULL, NULL, 0, sliding_window,
                                  share_blocks};
    if (!decode_attention_supported(&args)) return 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    decode_attention_team(&args, &failed);
    return failed;
}

/* The same over an 8-bit pool: k_cache/v_cache hold codes, k_scales/v_scales [N, H_kv]. */
int paged_decode_attention_q8(const void *q, int64_t q_stride, const void *k_cache,
                              const void *v_cache, const float *k_scales, const float *v_scales,
                              int kv_codes, const int64_t *block_tables, int64_t max_blocks,
                              const int64_t *seq_lens, void *out, int num_seqs, int num_q_heads,
                              int num_kv_heads, int head_dim, int block_size, float scale,
                              int is_bf16, int sliding_window, int num_threads) {
    const DecodeAttention args = {q, k_cache, v_cache, block_tables, seq_lens, out, q_stride,
                                  max_blocks, num_seqs, num_q_heads, num_kv_heads, head_dim,
                                  block_size, is_bf16, scale, k_scales, v_scales, kv_codes,
                                  sliding_window, 0};
    if (kv_codes < 1 || !decode_attention_supported(&args)) return 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    decode_attention_team(&args, &failed);
    return failed;
}
