/* Paged decode attention for bfloat16 with AVX-512 BF16 intrinsics: the fast path that
 * decode_attention.c tries first (it keeps the portable loop for everything else).
 *
 * Why a second kernel: the portable one was bound by instructions: every K row was widened
 * to float32 through a stack buffer and every q.k dot ended in a horizontal sum. Here
 *   - with AMX (and block sizes that are multiples of 16, at most 16 query heads), the scores
 *     of 16 keys against all query heads are tile products (score_keys_amx); otherwise q.k
 *     runs on bf16 pairs straight from the cache with VDPBF16PS, 16 scores summed at once by
 *     a transpose-add tree (sum16: ~3 ops per score),
 *   - the V pass keeps the output accumulators of one kv head's query heads in registers,
 *   - each pass walks a sequence's blocks once, all kv heads of a block before the next, so
 *     every block is read front to back, once,
 *   - each thread takes a contiguous run of sequences (split by tokens) and prefetches the
 *     next block into L2 while computing the current one, across passes and sequences.
 * In a full decode step the KV is not cache resident (KV plus weights exceed the share of L3
 * a process gets), so what counts is that memory transfers overlap the arithmetic. The kernel
 * comes close to the time of reading its bytes in this order; the gap is the software
 * prefetches' own limit (each holds one of the core's few line-fill buffers); prefetching a
 * whole pass ahead was no better, and 2 MiB pages cost more to fault in than they saved
 * (figures: bench/FIGURES.md).
 * Layouts are those of decode_attention.c; only the query may have a row stride (it is a
 * view of the fused QKV output, and copying it out would cost a pass over memory).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_shapes.h"
#include "team_ops.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "decode_bf16_blocks.h"
#include "x86_common.h"

#define CHUNK 16 /* scores summed per transpose-add tree: one per float32 lane */
#define MAX_GROUP 8 /* query heads per kv head (specialisations below) */
#define MAX_VECS 16 /* float32 vectors per head row: head_dim 256 */

ALWAYS_INLINE __m512 bf16x16_to_f32(const uint16_t *src) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

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

/* Scaled scores of every query head against all `len` keys into scores[h * len + t], and each
 * head's maximum over the keys from `first` on in max_score[h]. Block by block, all kv heads
 * of a block before the next, so the block's bytes are read once, front to back. */
ALWAYS_INLINE void score_keys(const Bf16Job *job, const int64_t *table, int64_t len, int64_t first,
                              const uint16_t *q, float *scores, float *max_score, NextPass then,
                              int DIM, int GROUP) {
    const int bs = job->block_size, NV = DIM / 32, heads = job->num_q_heads;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM; /* elements between tokens */
    const __m512 scale = _mm512_set1_ps(job->scale);
    for (int h = 0; h < heads; h++) max_score[h] = -FLT_MAX;
    for (int64_t start = 0; start < len; start += bs) {
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
 * query heads; the accumulators live in registers for the block. */
ALWAYS_INLINE void weigh_block(const uint16_t *rows, int count, int64_t stride, const float *probs,
                               ProbLayout layout, float *acc, Prefetch *fetch, int64_t share,
                               int DIM, int GROUP) {
    const int NF = DIM / 16;
    __m512 sum[MAX_GROUP][MAX_VECS];
    for (int g = 0; g < GROUP; g++)
        for (int j = 0; j < NF; j++) sum[g][j] = _mm512_loadu_ps(acc + g * DIM + 16 * j);
    for (int t = 0; t < count; t++) {
        prefetch_some(fetch, share);
        __m512 value[MAX_VECS];
        for (int j = 0; j < NF; j++) value[j] = bf16x16_to_f32(rows + t * stride + 16 * j);
        for (int g = 0; g < GROUP; g++) {
            __m512 p = _mm512_set1_ps(probs[g * layout.head + t * layout.token]);
            for (int j = 0; j < NF; j++) sum[g][j] = _mm512_fmadd_ps(p, value[j], sum[g][j]);
        }
    }
    for (int g = 0; g < GROUP; g++)
        for (int j = 0; j < NF; j++) _mm512_storeu_ps(acc + g * DIM + 16 * j, sum[g][j]);
}

/* out rows of every query head = sum_t p[h][t] * V[t] / sum[h], rounded to bf16; block by
 * block, all kv heads of a block before the next. acc: num_q_heads * DIM floats of scratch. */
ALWAYS_INLINE void weigh_values(const Bf16Job *job, const int64_t *table, int64_t len,
                                const float *probs, ProbLayout layout, const float *inv_sum,
                                float *acc, uint16_t *out, NextPass then, int DIM, int GROUP) {
    const int bs = job->block_size, heads = job->num_q_heads;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM;
    for (int64_t i = 0; i < (int64_t)heads * DIM; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
    for (int64_t start = 0; start < len; start += bs) {
        const uint16_t *rows = block_rows(job, job->v_cache, table, start / bs, DIM);
        int count = len - start < bs ? (int)(len - start) : bs;
        Prefetch fetch = prefetch_ahead_start(job, job->v_cache, table, start, len, then, DIM);
        const int64_t share = (fetch.left / (count * job->num_kv_heads) + 63) & ~(int64_t)63;
        for (int kv = 0; kv < job->num_kv_heads; kv++)
            weigh_block(rows + kv * DIM, count, stride,
                        probs + kv * GROUP * layout.head + start * layout.token, layout,
                        acc + kv * GROUP * DIM, &fetch, share, DIM, GROUP);
    }
    for (int h = 0; h < heads; h++) {
        __m512 inv = _mm512_set1_ps(inv_sum[h]);
        for (int j = 0; j < DIM / 16; j++)
            _mm256_storeu_si256((__m256i *)(out + h * DIM + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_loadu_ps(acc + h * DIM + 16 * j), inv)));
    }
}

#include "decode_scores_amx.h" /* with AMX: score_keys_amx, softmax_columns, AMX_SCORES */

/* Per-thread scratch: scores, per-head max and 1/sum (16 at least), V sums; with AMX, Q^T. */
typedef struct {
    float *scores, *max_score, *inv_sum, *acc;
    uint32_t *q_tiles; /* NULL: the dot-product path */
} Scratch;

/* Sequence `seq`; `next`: the one this thread attends next (its first block is prefetched
 * during the last V block of this one), or -1. */
ALWAYS_INLINE void attend_sequence(const Bf16Job *job, int seq, int next, const Scratch *scratch,
                                   int DIM, int GROUP) {
    /* whole blocks before the window are skipped: table and len from the window's block */
    const int64_t window_key = window_first_key(job->seq_lens[seq], job->sliding_window);
    const int64_t skipped = window_key / job->block_size * job->block_size;
    const int64_t len = job->seq_lens[seq] - skipped, first = window_key - skipped;
    const int64_t *table = job->block_tables + (int64_t)seq * job->max_blocks +
                           skipped / job->block_size;
    const uint16_t *q = job->q + seq * job->q_stride;
    const NextPass values = first_block(job, job->v_cache, seq, DIM);
    ProbLayout layout = {len, 1}; /* head-major */
#ifdef AMX_SCORES
    if (scratch->q_tiles != NULL) {
        pack_query_tiles(job, q, scratch->q_tiles, DIM, GROUP);
        score_keys_amx(job, table, len, scratch->q_tiles, scratch->scores, values, DIM);
        softmax_columns(scratch->scores, len, job->scale, scratch->inv_sum);
        layout = (ProbLayout){1, 16}; /* key-major */
    } else
#endif
    {
        score_keys(job, table, len, first, q, scratch->scores, scratch->max_score, values, DIM,
                   GROUP);
        softmax_rows(scratch->scores, len, first, scratch->max_score, scratch->inv_sum,
                     job->num_q_heads);
    }
    uint16_t *out = job->out + (int64_t)seq * job->num_q_heads * DIM;
    weigh_values(job, table, len, scratch->scores, layout, scratch->inv_sum, scratch->acc, out,
                 first_block(job, job->k_cache, next, DIM), DIM, GROUP);
}

#define SPECIALISE(DIM, GROUP)                                                              \
    static void attend_##DIM##_##GROUP(const Bf16Job *job, int seq, int next,                 \
                                       const Scratch *scratch) {                              \
        attend_sequence(job, seq, next, scratch, DIM, GROUP);                                 \
    }
DECODE_SHAPES(SPECIALISE)
DECODE_SHAPES_256(SPECIALISE)

typedef void (*AttendFn)(const Bf16Job *, int, int, const Scratch *);

/* Thread `me` of `threads` takes the sequences whose first context token falls in its equal
 * share of all context tokens: a contiguous run, so it knows which sequence comes next, with
 * about the same K/V traffic as the others. */
static void split_by_tokens(const int64_t *seq_lens, int num_seqs, int me, int threads,
                            int *begin, int *end) {
    int64_t total = 0, seen = 0;
    for (int s = 0; s < num_seqs; s++) total += seq_lens[s];
    const int64_t from = total * me / threads, to = total * (me + 1) / threads;
    *begin = *end = num_seqs;
    for (int s = 0; s < num_seqs; s++) {
        if (seen >= from && *begin == num_seqs) *begin = s;
        if (seen >= to) {
            *end = s;
            break;
        }
        seen += seq_lens[s];
    }
    if (*begin > *end) *begin = *end;
}

static AttendFn pick(int dim, int group) {
#define CASE(DIM, GROUP) if (dim == DIM && group == GROUP) return attend_##DIM##_##GROUP;
    DECODE_SHAPES(CASE)
    DECODE_SHAPES_256(CASE)
#undef CASE
    return NULL;
}

int decode_attention_bf16_supported(const DecodeAttention *args) {
    return args->is_bf16 && args->num_kv_heads > 0 &&
           args->num_q_heads % args->num_kv_heads == 0 &&
           pick(args->head_dim, args->num_q_heads / args->num_kv_heads) != NULL;
}

/* Whether this call scores on AMX: the CPU lets us, blocks hold whole 16-key chunks, and all
 * query heads fit the 16 columns of a tile. */
static int use_amx_scores(const DecodeAttention *args) {
#ifdef AMX_SCORES
    /* Windows and head_dim 256 keep the dot-product path: the tile path has no key mask and
     * its tiles are laid out for head_dim up to 128. */
    return args->block_size % 16 == 0 && args->num_q_heads <= 16 && !args->sliding_window &&
           args->head_dim <= 128 && amx_available();
#else
    (void)args;
    return 0;
#endif
}

/* One allocation per thread for its Scratch; returns it (to free), NULL when out of memory. */
static void *make_scratch(const DecodeAttention *args, int64_t longest, int amx,
                          Scratch *scratch) {
    const size_t heads = (size_t)args->num_q_heads, lanes = heads < 16 ? 16 : heads;
    const size_t score_floats = amx ? ((size_t)longest + 15) / 16 * 16 * 16 : heads * longest;
    const size_t tile_words = amx ? (size_t)args->num_kv_heads * (args->head_dim / 32) * 256 : 0;
    const size_t floats = score_floats + 2 * lanes + heads * args->head_dim + tile_words;
    float *buffer = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
    if (buffer == NULL) return NULL;
    scratch->scores = buffer;
    scratch->max_score = buffer + score_floats;
    scratch->inv_sum = scratch->max_score + lanes;
    scratch->acc = scratch->inv_sum + lanes;
    scratch->q_tiles = amx ? (uint32_t *)(scratch->acc + heads * args->head_dim) : NULL;
    if (amx) memset(scratch->q_tiles, 0, tile_words * 4); /* the columns that stay zero */
    return buffer;
}

void decode_attention_bf16_team(const DecodeAttention *args, int *failed) {
    AttendFn attend = pick(args->head_dim, args->num_q_heads / args->num_kv_heads);
    int64_t longest = 1;
    for (int s = 0; s < args->num_seqs; s++)
        if (args->seq_lens[s] > longest) longest = args->seq_lens[s];
    const Bf16Job job = {args->q, args->k_cache, args->v_cache, args->block_tables,
                         args->seq_lens, args->out, args->q_stride, args->max_blocks,
                         args->num_q_heads, args->num_kv_heads, args->block_size, args->scale,
                         args->sliding_window};
    const int amx = use_amx_scores(args);
    Scratch scratch;
    void *buffer = make_scratch(args, longest, amx, &scratch);
    if (buffer == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
    int begin, end;
    split_by_tokens(args->seq_lens, args->num_seqs, omp_get_thread_num(), omp_get_num_threads(),
                    &begin, &end);
#ifdef AMX_SCORES
    if (amx) configure_full_tiles();
#endif
    for (int seq = begin; buffer != NULL && seq < end; seq++)
        attend(&job, seq, seq + 1 < end ? seq + 1 : -1, &scratch);
#ifdef AMX_SCORES
    if (amx) _tile_release();
#endif
    free(buffer);
#pragma omp barrier
}

#else /* no AVX-512 BF16 on the build machine: the portable kernel does everything */

int decode_attention_bf16_supported(const DecodeAttention *args) { return 0; }
void decode_attention_bf16_team(const DecodeAttention *args, int *failed) {}

#endif
