/* Decode attention for sequences that begin with the same physical blocks (the parallel
 * samples of one prompt, requests behind one cached system prompt, beams and tree branches),
 * attended together as one unit: each shared K and V block is read from memory once for all
 * members and used for every member's queries while it is in L1; then each member's own
 * blocks as when it is alone. Without this, 128 requests behind a 1,500-token system prompt
 * read that prompt's K/V 128 times a step, many times the bytes of the weights.
 *
 * Reading fewer bytes alone does not make a step faster where the arithmetic then binds (it
 * does on 2-core AVX-512 machines), so the shared keys are also scored more cheaply: with the
 * unit's queries in the vector lanes, 16 queries per VDPBF16PS, with no horizontal sums
 * (score_shared_lanes). Those dot products are summed in another order than alone, so a
 * member's output can differ from its output alone in the last bit (bf16); its softmax and
 * value sums are the same operations in the same order (the shared V rows widened to float32
 * once for all members). Batch-invariant runs switch units off (share_blocks 0).
 *
 * Used by decode_attention_bf16.c (not for sliding windows: a member's window would start
 * inside the shared blocks); on AMX CPUs the shared passes are tile products instead
 * (decode_shared_amx.h), the members' own blocks as here. Members
 * must be neighbours in the batch; the scheduler keeps a request's samples together, and
 * requests behind one prompt arrive together.
 */
#ifndef PAGEDGEN_CPU_DECODE_SHARED_BLOCKS_H
#define PAGEDGEN_CPU_DECODE_SHARED_BLOCKS_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decode_bf16_blocks.h"
#include "decode_bf16_passes.h"
#include "decode_shared_amx.h" /* with AMX: score_shared_amx, weigh_shared_amx, AMX_UNITS */
#include "decode_units.h"      /* Unit, Member, pack_unit_queries, transpose16, fold_max */

/* Leading tokens of sequences a and b held in the same physical blocks, in whole blocks that
 * both have filled. */
static int64_t common_tokens(const Bf16Job *job, int a, int b) {
    const int64_t la = job->seq_lens[a], lb = job->seq_lens[b];
    const int64_t whole = (la < lb ? la : lb) / job->block_size;
    const int64_t *ta = job->block_tables + (int64_t)a * job->max_blocks;
    const int64_t *tb = job->block_tables + (int64_t)b * job->max_blocks;
    int64_t i = 0;
    while (i < whole && ta[i] == tb[i]) i++;
    return i * job->block_size;
}

/* The unit that starts at `seq`: its neighbours join while they share at least one block with
 * it and no fewer tokens than the unit so far, up to `members` sequences and `cap` context
 * tokens (so that one unit is not more than a thread's share). */
static Unit next_unit(const Bf16Job *job, int seq, int num_seqs, int members, int64_t cap) {
    Unit unit = {seq, 1, 0};
    int64_t tokens = job->seq_lens[seq];
    while (seq + unit.count < num_seqs && unit.count < members) {
        const int other = seq + unit.count;
        const int64_t common = common_tokens(job, seq, other);
        if (common == 0 || (unit.count > 1 && common < unit.shared)) break;
        if (tokens + job->seq_lens[other] > cap) break;
        if (unit.count == 1) unit.shared = common;
        tokens += job->seq_lens[other];
        unit.count++;
    }
    return unit;
}

/* K/V bytes a unit reads: its shared tokens once, each member's own tokens. */
static int64_t unit_tokens(const Bf16Job *job, Unit unit) {
    int64_t tokens = unit.shared;
    for (int m = 0; m < unit.count; m++) tokens += job->seq_lens[unit.first + m] - unit.shared;
    return tokens;
}

/* Thread `me` of `threads` takes the units whose first token (in the order units read their
 * tokens) falls in its equal share: a contiguous run of sequences [*begin, *end), so it knows
 * which comes next, with about the same K/V traffic as the others. Units are formed the same
 * way by every thread (from sequence 0), so their boundaries agree. */
static void split_units(const Bf16Job *job, int num_seqs, int members, int64_t cap, int me,
                        int threads, int *begin, int *end) {
    int64_t total = 0, seen = 0;
    for (int s = 0; s < num_seqs;) {
        const Unit unit = next_unit(job, s, num_seqs, members, cap);
        total += unit_tokens(job, unit);
        s += unit.count;
    }
    const int64_t from = total * me / threads, to = total * (me + 1) / threads;
    *begin = *end = num_seqs;
    for (int s = 0; s < num_seqs;) {
        const Unit unit = next_unit(job, s, num_seqs, members, cap);
        if (seen >= from && *begin == num_seqs) *begin = s;
        if (seen >= to) {
            *end = s;
            break;
        }
        seen += unit_tokens(job, unit);
        s += unit.count;
    }
    if (*begin > *end) *begin = *end;
}

/* A unit's queries (members x GROUP) from which the lanes path scores its shared keys: with
 * fewer, most of its 16 lanes would be empty and the row path (score_shared_rows) is cheaper. */
#define LANES_FROM 8

/* The shared blocks' keys against 16 of the unit's queries at a time, the queries in the lanes:
 * per key, one VDPBF16PS per dim pair with the key's pair broadcast from the cache row gives 16
 * scores, so no horizontal sums (the row path's sum16); 16 keys' vectors are transposed into
 * the members' score rows. Each shared K block is read from memory once. */
ALWAYS_INLINE void score_shared_lanes(const Bf16Job *job, const Scratch *scratch, Unit unit,
                                      NextPass then, int DIM, int GROUP) {
    const int bs = job->block_size, pairs = DIM / 2, queries = unit.count * GROUP;
    const int vectors = (queries + 15) / 16;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM;
    const __m512 scale = _mm512_set1_ps(job->scale);
    const int64_t *table = job->block_tables + (int64_t)unit.first * job->max_blocks;
    Member members[MAX_MEMBERS];
    for (int m = 0; m < unit.count; m++) members[m] = member_of(job, scratch, unit, m);
    pack_unit_queries(job, unit, scratch->unit_queries, DIM, GROUP);
    for (int64_t start = 0; start < unit.shared; start += bs) {
        const uint16_t *rows = block_rows(job, job->k_cache, table, start / bs, DIM);
        Prefetch fetch = prefetch_ahead_start(job, job->k_cache, table, start, unit.shared, then,
                                              DIM);
        const int64_t share = (fetch.left / (job->num_kv_heads * vectors) + 63) & ~(int64_t)63;
        for (int c = 0; c < bs; c += CHUNK) {
            const int n = bs - c < CHUNK ? bs - c : CHUNK;
            const __mmask16 valid = (__mmask16)((1u << n) - 1u);
            for (int kv = 0; kv < job->num_kv_heads; kv++) {
                const uint32_t *key[CHUNK]; /* past the block's end: its last key, masked */
                for (int t = 0; t < CHUNK; t++)
                    key[t] = (const uint32_t *)(rows + (int64_t)(c + (t < n ? t : n - 1)) * stride +
                                                kv * DIM);
                for (int v = 0; v < vectors; v++) {
                    prefetch_some(&fetch, share);
                    const uint32_t *packed =
                        scratch->unit_queries + ((int64_t)kv * vectors + v) * pairs * 16;
                    __m512 dots[CHUNK];
                    for (int t = 0; t < CHUNK; t++) dots[t] = _mm512_setzero_ps();
                    for (int p = 0; p < pairs; p++) {
                        const __m512bh q = (__m512bh)_mm512_loadu_si512(packed + p * 16);
                        for (int t = 0; t < CHUNK; t++)
                            dots[t] = _mm512_dpbf16_ps(
                                dots[t], q, (__m512bh)_mm512_set1_epi32((int)key[t][p]));
                    }
                    transpose16(dots); /* dots[r]: query 16 v + r against the 16 keys */
                    for (int r = 0; r < CHUNK && 16 * v + r < queries; r++) {
                        const int i = 16 * v + r;
                        const Member *member = &members[i / GROUP];
                        const int h = kv * GROUP + i % GROUP;
                        _mm512_mask_storeu_ps(member->scores + h * member->len + start + c, valid,
                                              _mm512_mul_ps(dots[r], scale));
                    }
                }
            }
        }
    }
    for (int m = 0; m < unit.count; m++) fold_max(&members[m], 0, unit.shared, job->num_q_heads);
}

/* The shared blocks' keys against every member's query heads: score_keys for each member, with
 * the loops over members inside, so a 16-key chunk is read from memory once. For units of few
 * queries, where the lanes path would leave most lanes empty. */
ALWAYS_INLINE void score_shared_rows(const Bf16Job *job, const Scratch *scratch, Unit unit,
                                     NextPass then, int DIM, int GROUP) {
    const int bs = job->block_size, NV = DIM / 32, heads = job->num_q_heads;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM;
    const __m512 scale = _mm512_set1_ps(job->scale);
    const int64_t *table = job->block_tables + (int64_t)unit.first * job->max_blocks;
    Member members[MAX_MEMBERS];
    for (int m = 0; m < unit.count; m++) members[m] = member_of(job, scratch, unit, m);
    for (int64_t start = 0; start < unit.shared; start += bs) {
        const uint16_t *rows = block_rows(job, job->k_cache, table, start / bs, DIM);
        Prefetch fetch = prefetch_ahead_start(job, job->k_cache, table, start, unit.shared, then,
                                              DIM);
        const int64_t share = (fetch.left / (heads * unit.count) + 63) & ~(int64_t)63;
        for (int c = 0; c < bs; c += CHUNK) {
            const int n = bs - c < CHUNK ? bs - c : CHUNK;
            const __mmask16 valid = (__mmask16)((1u << n) - 1u);
            for (int h = 0; h < heads; h++) {
                const uint16_t *chunk = rows + (int64_t)c * stride + (h / GROUP) * DIM;
                for (int m = 0; m < unit.count; m++) {
                    prefetch_some(&fetch, share);
                    const Member *member = &members[m];
                    const uint16_t *q = member->q + h * DIM;
                    __m512 s = n == CHUNK ? dot_chunk(chunk, CHUNK, stride, q, NV)
                                          : dot_chunk(chunk, n, stride, q, NV);
                    s = _mm512_mul_ps(s, scale);
                    _mm512_mask_storeu_ps(member->scores + h * member->len + start + c, valid, s);
                    member->max_score[h] =
                        fmaxf(member->max_score[h], _mm512_mask_reduce_max_ps(valid, s));
                }
            }
        }
    }
}

/* The shared blocks' values into every member's sums: weigh_values for each member, with the
 * loop over members inside, so a block's V rows are read from memory once, and widened to
 * float32 once (the values weigh_block would widen, so the same sums). */
ALWAYS_INLINE void weigh_shared_values(const Bf16Job *job, const Scratch *scratch, Unit unit,
                                       NextPass then, int DIM, int GROUP) {
    const int bs = job->block_size;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM;
    const int64_t *table = job->block_tables + (int64_t)unit.first * job->max_blocks;
    for (int64_t start = 0; start < unit.shared; start += bs) {
        const uint16_t *rows = block_rows(job, job->v_cache, table, start / bs, DIM);
        Prefetch fetch = prefetch_ahead_start(job, job->v_cache, table, start, unit.shared, then,
                                              DIM);
        const int64_t share =
            (fetch.left / ((int64_t)bs * job->num_kv_heads * unit.count) + 63) & ~(int64_t)63;
        for (int kv = 0; kv < job->num_kv_heads; kv++) {
            for (int t = 0; t < bs; t++)
                for (int j = 0; j < DIM / 16; j++)
                    _mm512_storeu_ps(scratch->unit_values + t * DIM + 16 * j,
                                     bf16x16_to_f32(rows + t * stride + kv * DIM + 16 * j));
            for (int m = 0; m < unit.count; m++) {
                const Member member = member_of(job, scratch, unit, m);
                weigh_block(rows + kv * DIM, scratch->unit_values, bs, stride,
                            member.scores + kv * GROUP * member.len + start,
                            (ProbLayout){member.len, 1}, member.acc + kv * GROUP * DIM, &fetch,
                            share, DIM, GROUP);
            }
        }
    }
}

/* A unit of several sequences; `next`: the sequence this thread attends after it, or -1. */
ALWAYS_INLINE void attend_unit(const Bf16Job *job, Unit unit, int next, const Scratch *scratch,
                               int DIM, int GROUP) {
    const int heads = job->num_q_heads;
    Member members[MAX_MEMBERS];
    for (int m = 0; m < unit.count; m++) {
        members[m] = member_of(job, scratch, unit, m);
        for (int h = 0; h < heads; h++) members[m].max_score[h] = -FLT_MAX;
        zero_floats(members[m].acc, (int64_t)heads * DIM);
    }
    const NextPass own_keys = block_from(job, job->k_cache, unit.first, unit.shared, DIM);
#ifdef AMX_UNITS
    const int tiles = scratch->value_tiles != NULL && (DIM == 64 || DIM == 128);
    if (tiles) {
        if (unit.shared > 0) { /* none for a sequence alone (alone_on_unit_tiles) */
            score_shared_amx(job, scratch, unit, members, own_keys, DIM, GROUP);
            for (int m = 0; m < unit.count; m++) fold_max(&members[m], 0, unit.shared, heads);
        }
    } else
#endif
    if (unit.count * GROUP >= LANES_FROM)
        score_shared_lanes(job, scratch, unit, own_keys, DIM, GROUP);
    else
        score_shared_rows(job, scratch, unit, own_keys, DIM, GROUP);
    for (int m = 0; m < unit.count; m++) {
        const Member member = member_of(job, scratch, unit, m);
        const NextPass then = m + 1 < unit.count
            ? block_from(job, job->k_cache, unit.first + m + 1, unit.shared, DIM)
            : block_from(job, job->v_cache, unit.first, 0, DIM);
#ifdef AMX_UNITS
        if (tiles && own_keys_on_tiles(heads, GROUP)) {
            score_own_amx(job, scratch, &member, unit.shared, then, DIM, GROUP);
            fold_max(&member, unit.shared, member.len, heads);
        } else
#endif
            score_keys(job, member.table, unit.shared, member.len, 0, member.q, member.scores,
                       member.max_score, then, DIM, GROUP);
        softmax_rows(member.scores, member.len, 0, member.max_score, member.inv_sum, heads);
    }
#ifdef AMX_UNITS
    if (tiles)
        weigh_shared_amx(job, scratch, unit, members, DIM, GROUP);
    else
#endif
        weigh_shared_values(job, scratch, unit,
                            block_from(job, job->v_cache, unit.first, unit.shared, DIM), DIM,
                            GROUP);
    for (int m = 0; m < unit.count; m++) {
        const Member member = member_of(job, scratch, unit, m);
        const NextPass then = m + 1 < unit.count
            ? block_from(job, job->v_cache, unit.first + m + 1, unit.shared, DIM)
            : first_block(job, job->k_cache, next, DIM);
        weigh_values(job, member.table, unit.shared, member.len, member.scores,
                     (ProbLayout){member.len, 1}, member.acc, then, DIM, GROUP);
        write_output(member.acc, member.inv_sum, job->out + (int64_t)(unit.first + m) * heads * DIM,
                     heads, DIM);
    }
}

#endif
#endif
