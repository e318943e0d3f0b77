/* Paged decode attention for bfloat16 on x86 CPUs with AVX2 and FMA but no AVX-512 BF16 (AMD
 * Zen 1-3, Intel Haswell to Alder Lake): the path decode_attention.c tries after the AVX-512
 * one. On such CPUs bf16 is the default dtype (our AVX2 GEMM multiplies it), and the portable
 * loop was bound by instructions: every K and V row widened through a stack buffer, every q.k
 * dot ending in a horizontal sum, the V sums in memory. Here
 *   - K and V stay bf16 in the cache and are widened in registers: a 32-bit lane holds a pair
 *     of values, a shift gives the first (even) one and a mask the second (odd). The query is
 *     stored in that even/odd order, so a dot product needs no reordering; the V sums are kept
 *     in it too and put back in order once per output row;
 *   - the dot products of KEYS keys by a group's query heads run as independent FMA chains
 *     (enough of them to hide the FMA latency), and each head's 8 partial vectors of 8 keys
 *     are summed by one hadd tree: 9 instructions for 8 scores;
 *   - the V pass keeps a slice of the group's output sums in registers over a whole block.
 * Each pass walks the sequence's blocks in order, all kv heads of a block before the next, so
 * every block is read once, front to back, and the next block is prefetched while one is
 * computed (decode_bf16_blocks.h: blocks are scattered, and the hardware prefetchers stop at
 * each block's end). Each thread takes a contiguous run of sequences, about its share of the
 * keys. A row's result depends on its own query and keys only (no sharing between sequences),
 * so it is batch-invariant. Layouts are those of decode_attention.c; only the query has a row
 * stride.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_shapes.h"
#include "team_ops.h"

/* Which decode-attention kernels bf16 pools may take: 0 the fastest the CPU has, 1 not the
 * AVX-512 ones (the AVX2 kernel or the portable loop), 2 only the portable loop. The tests run
 * every kernel the CPU can; the benchmarks compare them. */
static int kernel_choice = 0;

int decode_attention_kernel(int choice) {
    if (choice >= 0 && choice <= 2) __atomic_store_n(&kernel_choice, choice, __ATOMIC_RELAXED);
    return __atomic_load_n(&kernel_choice, __ATOMIC_RELAXED);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include "decode_bf16_blocks.h"
#include "x86_common.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define CHUNK 8       /* scores per hadd tree: one per float32 lane */
#define MAX_GROUP 8   /* query heads per kv head (the specialisations) */

typedef struct {
    float *q;      /* [heads][DIM]: the scaled query, each 16-value piece as 8 even, 8 odd */
    float *scores; /* [heads][len] */
    float *acc;    /* [heads][DIM]: V sums, in the query's even/odd order */
    float *inv_sum; /* [heads] */
} Avx2Scratch;

/* Keys whose dot products run at once: KEYS x GROUP chains of FMAs, at least 6 where the
 * group allows (an FMA's latency over its issue rate), at most 8 (the accumulators, two widened
 * vectors and a spare in the 16 ymm registers). */
ALWAYS_INLINE int keys_at_once(int GROUP) {
    return GROUP >= 8 ? 1 : GROUP >= 3 ? 2 : GROUP == 2 ? 4 : 8;
}

/* Lanes below n set: the valid keys of a partial chunk. */
ALWAYS_INLINE __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Lane t = the sum of the 8 lanes of v[t]. */
ALWAYS_INLINE __m256 sum8(const __m256 v[CHUNK]) {
    /* per 128-bit lane, hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3] */
    const __m256 low4 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 high4 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(low4, high4, 0x20),
                         _mm256_permute2f128_ps(low4, high4, 0x31));
}

/* The scaled query of every head into scratch, in even/odd order. */
ALWAYS_INLINE void load_query(const Bf16Job *job, const uint16_t *q, float *dst, int DIM) {
    const __m256 scale = _mm256_set1_ps(job->scale);
    for (int h = 0; h < job->num_q_heads; h++)
        for (int j = 0; j < DIM / 16; j++) {
            const __m256i pairs = _mm256_loadu_si256((const __m256i *)(q + h * DIM + 16 * j));
            float *piece = dst + h * DIM + 16 * j;
            _mm256_storeu_ps(piece, _mm256_mul_ps(bf16_pairs_even8(pairs), scale));
            _mm256_storeu_ps(piece + 8, _mm256_mul_ps(bf16_pairs_odd8(pairs), scale));
        }
}

/* part[g][t] (t < n): 8 partial sums of q_g . K[t] for the GROUP query heads of one kv head;
 * rows: key 0's row of that kv head, `stride` elements between keys. Lanes t >= n: zero. */
ALWAYS_INLINE void dot_chunk(const uint16_t *rows, int64_t stride, int n, const float *q,
                             __m256 part[MAX_GROUP][CHUNK], int DIM, int GROUP) {
    const int KEYS = keys_at_once(GROUP);
    for (int t0 = 0; t0 < CHUNK; t0 += KEYS) {
        __m256 acc[8][MAX_GROUP];
        for (int u = 0; u < KEYS; u++)
            for (int g = 0; g < GROUP; g++) acc[u][g] = _mm256_setzero_ps();
        for (int j = 0; j < DIM / 16; j++)
            for (int u = 0; u < KEYS; u++) {
                if (t0 + u >= n) continue;
                const __m256i pairs =
                    _mm256_loadu_si256((const __m256i *)(rows + (t0 + u) * stride + 16 * j));
                const __m256 even = bf16_pairs_even8(pairs), odd = bf16_pairs_odd8(pairs);
                for (int g = 0; g < GROUP; g++) {
                    const float *qg = q + g * DIM + 16 * j;
                    acc[u][g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg), even, acc[u][g]);
                    acc[u][g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8), odd, acc[u][g]);
                }
            }
        for (int u = 0; u < KEYS; u++)
            for (int g = 0; g < GROUP; g++) part[g][t0 + u] = acc[u][g];
    }
}

/* scores[h * len + t] for every query head and keys t in [from, len) (from: a block's first). */
ALWAYS_INLINE void score_keys(const Bf16Job *job, const int64_t *table, int64_t from, int64_t len,
                              const float *q, float *scores, NextPass then, int DIM, int GROUP) {
    const int bs = job->block_size, hkv = job->num_kv_heads;
    const int64_t stride = (int64_t)hkv * DIM; /* elements between tokens */
    __m256 part[MAX_GROUP][CHUNK];
    for (int64_t start = from; start < len; start += bs) {
        const uint16_t *block = block_rows(job, job->k_cache, table, start / bs, DIM);
        const int count = len - start < bs ? (int)(len - start) : bs;
        Prefetch fetch = prefetch_ahead_start(job, job->k_cache, table, start, len, then, DIM);
        const int64_t chunks = hkv * ((count + CHUNK - 1) / CHUNK);
        const int64_t share = (fetch.left / chunks + 63) & ~(int64_t)63;
        for (int kv = 0; kv < hkv; kv++)
            for (int c = 0; c < count; c += CHUNK) {
                const int n = count - c < CHUNK ? count - c : CHUNK;
                prefetch_some(&fetch, share);
                const uint16_t *rows = block + c * stride + kv * DIM;
                /* Two copies so that full chunks (nearly all) have no key test. */
                const float *qg = q + kv * GROUP * DIM;
                if (n == CHUNK) dot_chunk(rows, stride, CHUNK, qg, part, DIM, GROUP);
                else dot_chunk(rows, stride, n, qg, part, DIM, GROUP);
                for (int g = 0; g < GROUP; g++) {
                    float *dst = scores + (kv * GROUP + g) * len + start + c;
                    if (n == CHUNK) _mm256_storeu_ps(dst, sum8(part[g]));
                    else _mm256_maskstore_ps(dst, lanes_below(n), sum8(part[g]));
                }
            }
    }
}

/* scores[h] over keys [from, len) <- exp(score - max over [first, len)), 0 before `first`;
 * inv_sum[h] = 1 / their sum. */
ALWAYS_INLINE void softmax_rows(float *scores, int64_t from, int64_t first, int64_t len, int heads,
                                float *inv_sum) {
    for (int h = 0; h < heads; h++) {
        float *row = scores + h * len;
        __m256 top = _mm256_set1_ps(-FLT_MAX);
        for (int64_t t = first; t < len; t += CHUNK) {
            const int n = len - t < CHUNK ? (int)(len - t) : CHUNK;
            const __m256i valid = lanes_below(n);
            const __m256 s = _mm256_maskload_ps(row + t, valid);
            top = _mm256_blendv_ps(top, _mm256_max_ps(top, s), _mm256_castsi256_ps(valid));
        }
        top = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 1));
        top = _mm256_max_ps(top, _mm256_permute_ps(top, _MM_SHUFFLE(1, 0, 3, 2)));
        top = _mm256_max_ps(top, _mm256_permute_ps(top, _MM_SHUFFLE(2, 3, 0, 1)));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = from; t < len; t += CHUNK) {
            const int n = len - t < CHUNK ? (int)(len - t) : CHUNK;
            const __m256i valid = lanes_below(n);
            /* keys seen: lane i is key t + i, seen from `first` on (a window's first key) */
            const __m256i keys = _mm256_add_epi32(_mm256_set1_epi32((int)(t - first)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            const __m256i seen =
                _mm256_and_si256(valid, _mm256_cmpgt_epi32(keys, _mm256_set1_epi32(-1)));
            const __m256 x = _mm256_sub_ps(_mm256_maskload_ps(row + t, valid), top);
            __m256 e = exp2_8_nonpositive(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)));
            e = _mm256_and_ps(e, _mm256_castsi256_ps(seen));
            _mm256_maskstore_ps(row + t, valid, e);
            sum = _mm256_add_ps(sum, e);
        }
        sum = _mm256_add_ps(sum, _mm256_permute2f128_ps(sum, sum, 1));
        sum = _mm256_hadd_ps(sum, sum);
        sum = _mm256_hadd_ps(sum, sum);
        inv_sum[h] = 1.0f / _mm_cvtss_f32(_mm256_castps256_ps128(sum));
    }
}

/* Query heads of a group whose V sums share registers, and 16-value pieces per pass: 2 x HEADS
 * x PIECES accumulators, at most 8, so that they, a broadcast weight per head, the widened pair
 * and the mask fit the 16 ymm registers (one more and an accumulator round-trips through the
 * stack every key). */
ALWAYS_INLINE int heads_at_once(int GROUP) { return GROUP <= 4 ? GROUP : GROUP / 2; }
ALWAYS_INLINE int pieces_at_once(int heads, int DIM) {
    const int pieces = heads == 1 ? 4 : heads == 2 ? 2 : 1;
    return pieces < DIM / 16 ? pieces : DIM / 16;
}

/* acc[i] += sum over a block's `count` keys of p[i][t] * V[t] for HEADS query heads (acc and
 * probs `DIM` and `len` floats apart), on PIECES pieces from `piece` on. */
ALWAYS_INLINE void weigh_slice(const uint16_t *rows, int64_t stride, int count, const float *probs,
                               int64_t len, float *acc, int piece, int DIM, int HEADS, int PIECES) {
    __m256 sum[MAX_GROUP][4][2];
    for (int i = 0; i < HEADS; i++)
        for (int s = 0; s < PIECES; s++) {
            sum[i][s][0] = _mm256_loadu_ps(acc + i * DIM + 16 * (piece + s));
            sum[i][s][1] = _mm256_loadu_ps(acc + i * DIM + 16 * (piece + s) + 8);
        }
    for (int t = 0; t < count; t++) {
        for (int s = 0; s < PIECES; s++) {
            const __m256i pairs =
                _mm256_loadu_si256((const __m256i *)(rows + t * stride + 16 * (piece + s)));
            const __m256 even = bf16_pairs_even8(pairs), odd = bf16_pairs_odd8(pairs);
            for (int i = 0; i < HEADS; i++) {
                const __m256 p = _mm256_broadcast_ss(probs + i * len + t);
                sum[i][s][0] = _mm256_fmadd_ps(p, even, sum[i][s][0]);
                sum[i][s][1] = _mm256_fmadd_ps(p, odd, sum[i][s][1]);
            }
        }
    }
    for (int i = 0; i < HEADS; i++)
        for (int s = 0; s < PIECES; s++) {
            _mm256_storeu_ps(acc + i * DIM + 16 * (piece + s), sum[i][s][0]);
            _mm256_storeu_ps(acc + i * DIM + 16 * (piece + s) + 8, sum[i][s][1]);
        }
}

/* acc[h] += sum over keys [from, len) of p[h][t] * V[t], block by block. */
ALWAYS_INLINE void weigh_values(const Bf16Job *job, const int64_t *table, int64_t from, int64_t len,
                                const float *probs, float *acc, NextPass then, int DIM, int GROUP) {
    const int bs = job->block_size, hkv = job->num_kv_heads;
    const int HEADS = heads_at_once(GROUP), PIECES = pieces_at_once(HEADS, DIM);
    const int64_t stride = (int64_t)hkv * DIM;
    const int slices = hkv * (GROUP / HEADS) * (DIM / 16 / PIECES);
    for (int64_t start = from; start < len; start += bs) {
        const uint16_t *block = block_rows(job, job->v_cache, table, start / bs, DIM);
        const int count = len - start < bs ? (int)(len - start) : bs;
        Prefetch fetch = prefetch_ahead_start(job, job->v_cache, table, start, len, then, DIM);
        const int64_t share = (fetch.left / slices + 63) & ~(int64_t)63;
        for (int kv = 0; kv < hkv; kv++)
            for (int g = 0; g < GROUP; g += HEADS) {
                const int h = kv * GROUP + g;
                for (int piece = 0; piece < DIM / 16; piece += PIECES, prefetch_some(&fetch, share))
                    weigh_slice(block + kv * DIM, stride, count, probs + h * len + start, len,
                                acc + h * DIM, piece, DIM, HEADS, PIECES);
            }
    }
}

/* out[h] = acc[h] / sum[h], put back from even/odd order and rounded to bf16. */
ALWAYS_INLINE void write_output(const float *acc, const float *inv_sum, uint16_t *out, int heads,
                                int DIM) {
    for (int h = 0; h < heads; h++) {
        const __m256 inv = _mm256_set1_ps(inv_sum[h]);
        for (int j = 0; j < DIM / 16; j++) {
            const __m256 even = _mm256_mul_ps(_mm256_loadu_ps(acc + h * DIM + 16 * j), inv);
            const __m256 odd = _mm256_mul_ps(_mm256_loadu_ps(acc + h * DIM + 16 * j + 8), inv);
            /* per 128-bit lane: values [0-3 | 8-11] and [4-7 | 12-15] */
            const __m256 a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);
            bf16x16_store_rounded(out + h * DIM + 16 * j,
                                  bf16x8_round(_mm256_permute2f128_ps(a, b, 0x20)),
                                  bf16x8_round(_mm256_permute2f128_ps(a, b, 0x31)));
        }
    }
}

/* The first key of `seq` the passes read: the first of the block where its window starts. */
ALWAYS_INLINE int64_t first_key_read(const Bf16Job *job, int seq) {
    const int64_t first = window_first_key(job->seq_lens[seq], job->sliding_window);
    return first / job->block_size * job->block_size;
}

/* Sequence `seq`; `next`: the one this thread attends next (its first K block is prefetched
 * during the last V block of this one), or -1. */
ALWAYS_INLINE void attend_sequence(const Bf16Job *job, int seq, int next,
                                   const Avx2Scratch *scratch, int DIM, int GROUP) {
    /* blocks wholly before the window are not read (their entries may name freed blocks) */
    const int64_t len = job->seq_lens[seq], first = window_first_key(len, job->sliding_window);
    const int64_t from = first_key_read(job, seq);
    const int64_t *table = job->block_tables + (int64_t)seq * job->max_blocks;
    const int heads = job->num_q_heads;
    load_query(job, job->q + seq * job->q_stride, scratch->q, DIM);
    score_keys(job, table, from, len, scratch->q, scratch->scores,
               block_from(job, job->v_cache, seq, from, DIM), DIM, GROUP);
    softmax_rows(scratch->scores, from, first, len, heads, scratch->inv_sum);
    for (int64_t i = 0; i < (int64_t)heads * DIM; i += 8)
        _mm256_storeu_ps(scratch->acc + i, _mm256_setzero_ps());
    weigh_values(job, table, from, len, scratch->scores, scratch->acc,
                 block_from(job, job->k_cache, next, next < 0 ? 0 : first_key_read(job, next), DIM),
                 DIM, GROUP);
    write_output(scratch->acc, scratch->inv_sum, job->out + (int64_t)seq * heads * DIM, heads, DIM);
}

#define SPECIALISE(DIM, GROUP)                                                               \
    static void attend_##DIM##_##GROUP(const Bf16Job *job, int seq, int next,              \
                                       const Avx2Scratch *s) {                               \
        attend_sequence(job, seq, next, s, DIM, GROUP);                                      \
    }
DECODE_SHAPES(SPECIALISE)
DECODE_SHAPES_256(SPECIALISE)

typedef void (*AttendFn)(const Bf16Job *, int, int, const Avx2Scratch *);

static AttendFn pick(int dim, int group) {
    DECODE_SHAPES(DECODE_PICK_CASE)
    DECODE_SHAPES_256(DECODE_PICK_CASE)
    return NULL;
}

int decode_attention_avx2_supported(const DecodeAttention *args) {
    return args->is_bf16 && !args->kv_codes && args->num_kv_heads > 0 &&
           args->num_q_heads % args->num_kv_heads == 0 &&
           pick(args->head_dim, args->num_q_heads / args->num_kv_heads) != NULL;
}

/* This thread's run of sequences [begin, end): contiguous (so that it knows the next one to
 * prefetch), about a thread's share of the keys read. */
static void split_by_keys(const Bf16Job *job, int num_seqs, int me, int threads, int *begin,
                          int *end) {
    int64_t total = 0, seen = 0;
    for (int s = 0; s < num_seqs; s++) total += job->seq_lens[s] - first_key_read(job, s);
    const int64_t from = total * me / threads, to = total * (me + 1) / threads;
    *begin = *end = num_seqs;
    for (int s = 0; s < num_seqs; s++) {
        if (seen >= from && *begin == num_seqs) *begin = s;
        if (seen >= to) {
            *end = s;
            break;
        }
        seen += job->seq_lens[s] - first_key_read(job, s);
    }
    if (*begin > *end) *begin = *end;
}

void decode_attention_avx2_team(const DecodeAttention *args, int *failed) {
    const AttendFn attend = pick(args->head_dim, args->num_q_heads / args->num_kv_heads);
    int64_t longest = 1;
    for (int s = 0; s < args->num_seqs; s++)
        if (args->seq_lens[s] > longest) longest = args->seq_lens[s];
    const Bf16Job job = {.q = args->q, .k_cache = args->k_cache, .v_cache = args->v_cache,
                         .block_tables = args->block_tables, .seq_lens = args->seq_lens,
                         .out = args->out, .q_stride = args->q_stride,
                         .max_blocks = args->max_blocks, .num_q_heads = args->num_q_heads,
                         .num_kv_heads = args->num_kv_heads, .block_size = args->block_size,
                         .scale = args->scale, .sliding_window = args->sliding_window};
    const size_t heads = (size_t)args->num_q_heads, dim = (size_t)args->head_dim;
    const size_t floats = 2 * heads * dim + heads * (size_t)longest + heads;
    float *buffer = malloc(sizeof(float) * floats);
    if (buffer == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
    const size_t scores = heads * (size_t)longest;
    const Avx2Scratch scratch = {buffer, buffer + heads * dim, buffer + heads * dim + scores,
                                 buffer + 2 * heads * dim + scores};
    int begin, end;
    split_by_keys(&job, args->num_seqs, omp_get_thread_num(), omp_get_num_threads(), &begin, &end);
    for (int seq = begin; buffer != NULL && seq < end; seq++)
        attend(&job, seq, seq + 1 < end ? seq + 1 : -1, &scratch);
    free(buffer);
#pragma omp barrier
}

#else /* no AVX2 and FMA on the build machine: the portable kernel does everything */

int decode_attention_avx2_supported(const DecodeAttention *args) { (void)args; return 0; }
void decode_attention_avx2_team(const DecodeAttention *args, int *failed) {
    (void)args, (void)failed;
}

#endif
