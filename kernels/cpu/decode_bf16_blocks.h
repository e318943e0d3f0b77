/* What the bf16 decode-attention kernels share (decode_attention_bf16.c with its AMX part,
 * decode_scores_amx.h, and decode_attention_avx2.c): the job description, where a block's rows
 * are, and the prefetching of the block ahead. Needs AVX2 (every AVX-512 build has it); empty
 * on other builds. */
#ifndef PAGEDGEN_CPU_DECODE_BF16_BLOCKS_H
#define PAGEDGEN_CPU_DECODE_BF16_BLOCKS_H

#if defined(__AVX2__)
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#ifndef ALWAYS_INLINE
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#endif

typedef struct {
    const uint16_t *q, *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    uint16_t *out;
    int64_t q_stride, max_blocks;
    int num_q_heads, num_kv_heads, block_size;
    float scale;
    int sliding_window; /* DecodeAttention's */
} Bf16Job;

/* K or V rows of token 0 of logical block `index` (all kv heads; the block's tokens follow at
 * a stride of num_kv_heads * DIM elements). */
ALWAYS_INLINE const uint16_t *block_rows(const Bf16Job *job, const uint16_t *cache,
                                         const int64_t *table, int64_t index, int DIM) {
    return cache + table[index] * job->block_size * job->num_kv_heads * DIM;
}

/* Blocks are scattered, so the hardware prefetchers stop at every block boundary: the next
 * block is fetched into L2 (T1: L1 is too small to hold it beside the current one) while the
 * current one is computed, a few lines at a time spread over the computation. A burst of
 * prefetches fills the line-fill buffers and stalls the arithmetic until they land; fetching
 * two blocks ahead was no better (bench/FIGURES.md). */
typedef struct {
    const char *next; /* next line to fetch */
    int64_t left;     /* bytes left to fetch of the block ahead */
} Prefetch;

/* The block a pass's last block hands the prefetching on to: the first block of the pass that
 * follows (V after K; the next sequence's K after V), or none. */
typedef struct {
    const char *rows;
    int64_t bytes;
} NextPass;

/* The block that holds token `from` of `seq` and what of it is left, for the prefetch chain;
 * none for seq -1 or past its end. */
ALWAYS_INLINE NextPass block_from(const Bf16Job *job, const uint16_t *cache, int seq,
                                  int64_t from, int DIM) {
    NextPass next = {NULL, 0};
    if (seq < 0 || from >= job->seq_lens[seq]) return next;
    const int64_t left = job->seq_lens[seq] - from;
    const int64_t *table = job->block_tables + (int64_t)seq * job->max_blocks;
    next.rows = (const char *)block_rows(job, cache, table, from / job->block_size, DIM);
    next.bytes = (left < job->block_size ? left : job->block_size) * job->num_kv_heads * DIM * 2;
    return next;
}

ALWAYS_INLINE NextPass first_block(const Bf16Job *job, const uint16_t *cache, int seq, int DIM) {
    return block_from(job, cache, seq, 0, DIM);
}

ALWAYS_INLINE Prefetch prefetch_ahead_start(const Bf16Job *job, const uint16_t *cache,
                                            const int64_t *table, int64_t start, int64_t len,
                                            NextPass then, int DIM) {
    Prefetch fetch = {NULL, 0};
    const int64_t ahead = start + job->block_size;
    if (ahead >= len) {
        fetch.next = then.rows;
        fetch.left = then.bytes;
        return fetch;
    }
    fetch.next = (const char *)block_rows(job, cache, table, ahead / job->block_size, DIM);
    int64_t tokens = len - ahead < job->block_size ? len - ahead : job->block_size;
    fetch.left = tokens * job->num_kv_heads * DIM * 2;
    return fetch;
}

ALWAYS_INLINE void prefetch_some(Prefetch *fetch, int64_t bytes) {
    for (; fetch->left > 0 && bytes > 0; bytes -= 64, fetch->left -= 64, fetch->next += 64)
        _mm_prefetch(fetch->next, _MM_HINT_T1);
}

#endif
#endif
