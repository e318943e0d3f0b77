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
 *     next block into L2 while computing the current one, across passes and sequences;
 *   - neighbours that begin with the same blocks are attended as one unit, each shared block
 *     read once for all of them (decode_shared_blocks.h; with AMX, decode_shared_amx.h).
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

#include "decode_bf16_passes.h"  /* score_keys, softmax_rows, weigh_values, Scratch */
#include "decode_scores_amx.h"   /* with AMX: score_keys_amx, softmax_columns, AMX_SCORES */

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
        for (int h = 0; h < job->num_q_heads; h++) scratch->max_score[h] = -FLT_MAX;
        score_keys(job, table, 0, len, first, q, scratch->scores, scratch->max_score, values, DIM,
                   GROUP);
        softmax_rows(scratch->scores, len, first, scratch->max_score, scratch->inv_sum,
                     job->num_q_heads);
    }
    zero_floats(scratch->acc, (int64_t)job->num_q_heads * DIM);
    weigh_values(job, table, 0, len, scratch->scores, layout, scratch->acc,
                 first_block(job, job->k_cache, next, DIM), DIM, GROUP);
    write_output(scratch->acc, scratch->inv_sum, job->out + (int64_t)seq * job->num_q_heads * DIM,
                 job->num_q_heads, DIM);
}

#include "decode_shared_blocks.h" /* units of sequences that share blocks: attend_unit */

/* Whether a sequence alone is attended as a unit of one on the tile unit: where its query
 * heads do not fit the one score tile of the AMX score path (more than 16) but fit the units'
 * own-key tiles, which beat the dot-product path. */
ALWAYS_INLINE int alone_on_unit_tiles(const Scratch *scratch, int heads, int group) {
#ifdef AMX_UNITS
    return scratch->value_tiles != NULL && scratch->q_tiles == NULL &&
           own_keys_on_tiles(heads, group);
#else
    (void)scratch, (void)heads, (void)group;
    return 0;
#endif
}

#define SPECIALISE(DIM, GROUP)                                                              \
    static void attend_##DIM##_##GROUP(const Bf16Job *job, Unit unit, int next,               \
                                       const Scratch *scratch) {                              \
        if (unit.count == 1 && !alone_on_unit_tiles(scratch, job->num_q_heads, GROUP))        \
            attend_sequence(job, unit.first, next, scratch, DIM, GROUP);                      \
        else                                                                                  \
            attend_unit(job, unit, next, scratch, DIM, GROUP);                                \
    }
DECODE_SHAPES(SPECIALISE)
DECODE_SHAPES_256(SPECIALISE)

typedef void (*AttendFn)(const Bf16Job *, Unit, int, const Scratch *);

static AttendFn pick(int dim, int group) {
    DECODE_SHAPES(DECODE_PICK_CASE)
    DECODE_SHAPES_256(DECODE_PICK_CASE)
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

/* 1: units of sequences that share blocks run on the tile unit where the CPU lets them
 * (decode_shared_amx.h); 0: on their vector passes (the tests run both on AMX CPUs). */
static int unit_form = 1;

int decode_attention_unit_form(int form) {
    if (form == 0 || form == 1) __atomic_store_n(&unit_form, form, __ATOMIC_RELAXED);
    return __atomic_load_n(&unit_form, __ATOMIC_RELAXED);
}

/* Whether this call's units run on the tile unit: as for the scores alone, but any number of
 * query heads (a unit's queries are packed 16 to a tile whatever they are), head_dim 64 or 128. */
static int use_amx_units(const DecodeAttention *args) {
#ifdef AMX_UNITS
    return decode_attention_unit_form(-2) && args->block_size % 16 == 0 &&
           !args->sliding_window && (args->head_dim == 64 || args->head_dim == 128) &&
           amx_available();
#else
    (void)args;
    return 0;
#endif
}

/* Sequences per unit: 1 where units do not apply, else as many as MEMBER_SCORE_BYTES of
 * scores hold, at most MAX_MEMBERS. With AMX scores and no tile units, members are attended
 * alone: re-reading the shared blocks from L3 with tile products beat the vector passes. */
static int unit_members(const DecodeAttention *args, int64_t longest, int amx, int amx_units) {
    if (!args->share_blocks || (amx && !amx_units) || args->sliding_window > 0) return 1;
    const int64_t per_member = (int64_t)args->num_q_heads * longest * 4;
    const int64_t fit = MEMBER_SCORE_BYTES / per_member;
    return fit < 1 ? 1 : fit > MAX_MEMBERS ? MAX_MEMBERS : (int)fit;
}

/* One allocation per thread for its Scratch; returns it (to free), NULL when out of memory. */
static void *make_scratch(const DecodeAttention *args, int64_t longest, int amx, int amx_units,
                          int members, Scratch *scratch) {
    /* unit buffers: for units, and for sequences alone that run as units of one */
    const int units = members > 1 || (amx_units && !amx);
    const size_t heads = (size_t)args->num_q_heads, lanes = heads < 16 ? 16 : heads;
    const size_t score_floats = amx ? ((size_t)longest + 15) / 16 * 16 * 16 : heads * longest;
    const size_t tile_words = amx ? (size_t)args->num_kv_heads * (args->head_dim / 32) * 256 : 0;
    const size_t group = heads / (size_t)args->num_kv_heads;
    const size_t unit_words = units ? (size_t)args->num_kv_heads *
        ((members * group + 15) / 16) * (args->head_dim / 2) * 16 : 0;
    const size_t value_floats = units ? (size_t)args->block_size * args->head_dim : 0;
    /* units' tiles: SEGMENT_KEYS keys of V (head_dim / 16 tiles per 32 keys), of P (two tiles
     * per 32 keys), four output tiles and a member's Q^T, each 1 KB and 64-byte aligned */
#ifdef AMX_UNITS
    const size_t segment_steps = SEGMENT_KEYS / 32;
#else
    const size_t segment_steps = 0;
#endif
    const size_t own_q_words = (size_t)args->num_kv_heads * (args->head_dim / 32) * 256;
    const size_t unit_tile_words = units && amx_units
        ? (segment_steps * (args->head_dim / 16 + 2) + 4) * 256 + own_q_words : 0;
    const size_t before_tiles = (members * (score_floats + 2 * lanes + heads * args->head_dim) +
                                 tile_words + unit_words + value_floats + 15) / 16 * 16;
    const size_t floats = before_tiles + unit_tile_words;
    float *buffer = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
    if (buffer == NULL) return NULL;
    scratch->score_floats = (int64_t)score_floats;
    scratch->lanes = (int)lanes;
    scratch->head_dim = args->head_dim;
    scratch->scores = buffer;
    scratch->max_score = buffer + members * score_floats;
    scratch->inv_sum = scratch->max_score + members * lanes;
    scratch->acc = scratch->inv_sum + members * lanes;
    float *after = scratch->acc + members * heads * args->head_dim;
    scratch->q_tiles = amx ? (uint32_t *)after : NULL;
    scratch->unit_queries = units ? (uint32_t *)(after + tile_words) : NULL;
    scratch->unit_values = units ? after + tile_words + unit_words : NULL;
    scratch->value_tiles = unit_tile_words ? (uint32_t *)(buffer + before_tiles) : NULL;
    scratch->prob_tiles = unit_tile_words
        ? (uint16_t *)(scratch->value_tiles + segment_steps * (args->head_dim / 16) * 256)
        : NULL;
    scratch->tile_out =
        unit_tile_words ? (float *)(scratch->prob_tiles + segment_steps * 1024) : NULL;
    scratch->own_q_tiles = unit_tile_words ? (uint32_t *)(scratch->tile_out + 4 * 256) : NULL;
    if (unit_tile_words) memset(scratch->own_q_tiles, 0, own_q_words * 4); /* as q_tiles */
    if (amx) memset(scratch->q_tiles, 0, tile_words * 4); /* the columns that stay zero */
    return buffer;
}

void decode_attention_bf16_team(const DecodeAttention *args, int *failed) {
    AttendFn attend = pick(args->head_dim, args->num_q_heads / args->num_kv_heads);
    int64_t longest = 1, total = 0;
    for (int s = 0; s < args->num_seqs; s++) {
        if (args->seq_lens[s] > longest) longest = args->seq_lens[s];
        total += args->seq_lens[s];
    }
    const Bf16Job job = {args->q, args->k_cache, args->v_cache, args->block_tables,
                         args->seq_lens, args->out, args->q_stride, args->max_blocks,
                         args->num_q_heads, args->num_kv_heads, args->block_size, args->scale,
                         args->sliding_window};
    const int amx = use_amx_scores(args), amx_units = use_amx_units(args);
    const int threads = omp_get_num_threads();
    const int members = unit_members(args, longest, amx, amx_units);
    const int64_t cap = (total + threads - 1) / threads; /* a unit's tokens: a thread's share */
    Scratch scratch;
    void *buffer = make_scratch(args, longest, amx, amx_units, members, &scratch);
    if (buffer == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
    int begin, end;
    split_units(&job, args->num_seqs, members, cap, omp_get_thread_num(), threads, &begin, &end);
#ifdef AMX_SCORES
    if (amx || amx_units) configure_full_tiles();
#endif
    for (int seq = begin; buffer != NULL && seq < end;) {
        const Unit unit = next_unit(&job, seq, end, members, cap);
        seq += unit.count;
        attend(&job, unit, seq < end ? seq : -1, &scratch);
    }
#ifdef AMX_SCORES
    if (amx || amx_units) _tile_release();
#endif
    free(buffer);
#pragma omp barrier
}

#else /* no AVX-512 BF16 on the build machine: the portable kernel does everything */

int decode_attention_bf16_supported(const DecodeAttention *args) { return 0; }
void decode_attention_bf16_team(const DecodeAttention *args, int *failed) {}
int decode_attention_unit_form(int form) { return 0; }

#endif
