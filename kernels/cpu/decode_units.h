/* A unit of sequences that share their leading blocks and its members' slices of the scratch,
 * with what both unit paths use (decode_shared_blocks.h on vector passes, decode_shared_amx.h
 * on the tile unit): the unit's queries packed 16 to a vector, a 16 x 16 transpose, and the
 * fold of a member's row maxima. Needs AVX-512 F/BW/BF16; empty on other builds. */
#ifndef PAGEDGEN_CPU_DECODE_UNITS_H
#define PAGEDGEN_CPU_DECODE_UNITS_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decode_bf16_blocks.h"
#include "decode_bf16_passes.h"

#define MAX_MEMBERS 16 /* sequences per unit: past 16 the shared bytes are already small */
/* Scores of a unit's members live together in one thread's scratch; long contexts take fewer
 * members per unit rather than more memory. */
#define MEMBER_SCORE_BYTES (8 << 20)

/* Sequences [first, first + count) of the batch; their first `shared` tokens (whole blocks)
 * are in the same physical blocks. count 1: a sequence alone (shared 0). */
typedef struct {
    int first, count;
    int64_t shared;
} Unit;

/* Member m's slice of the scratch. */
typedef struct {
    float *scores, *max_score, *inv_sum, *acc;
    int64_t len;
    const int64_t *table;
    const uint16_t *q;
} Member;

ALWAYS_INLINE Member member_of(const Bf16Job *job, const Scratch *scratch, Unit unit, int m) {
    const int seq = unit.first + m;
    Member member = {scratch->scores + m * scratch->score_floats,
                     scratch->max_score + m * scratch->lanes, scratch->inv_sum + m * scratch->lanes,
                     scratch->acc + (int64_t)m * job->num_q_heads * scratch->head_dim,
                     job->seq_lens[seq], job->block_tables + (int64_t)seq * job->max_blocks,
                     job->q + seq * job->q_stride};
    return member;
}

ALWAYS_INLINE __mmask16 first_lanes16(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
}

/* The unit's queries of kv head `kv`, every member's GROUP heads in turn (query i: member
 * i / GROUP, head kv * GROUP + i % GROUP), packed 16 to a vector as dim pairs: word r of pair
 * p of vector v is pair p of query 16 v + r (0 past the last query). */
ALWAYS_INLINE void pack_unit_queries(const Bf16Job *job, Unit unit, uint32_t *packed, int DIM,
                                     int GROUP) {
    const int queries = unit.count * GROUP, vectors = (queries + 15) / 16, pairs = DIM / 2;
    for (int kv = 0; kv < job->num_kv_heads; kv++)
        for (int i = 0; i < vectors * 16; i++) {
            uint32_t *lane = packed + ((int64_t)kv * vectors + i / 16) * pairs * 16 + i % 16;
            const uint16_t *q = job->q + (unit.first + i / GROUP) * job->q_stride +
                                (kv * GROUP + i % GROUP) * DIM;
            for (int p = 0; p < pairs; p++) {
                uint32_t pair = 0;
                if (i < queries) memcpy(&pair, q + 2 * p, 4);
                lane[p * 16] = pair;
            }
        }
}

/* 16 x 16 floats: v[r] lane t <- v[t] lane r. */
ALWAYS_INLINE void transpose16(__m512 v[16]) {
    __m512 a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 2; j++) {
            __m512d x = _mm512_castps_pd(a[4 * i + j]), y = _mm512_castps_pd(a[4 * i + j + 2]);
            b[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
            b[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
        }
    /* b[4i + k]: rows 4i..4i+3, element k of each 4-lane group; now the 128-bit groups */
    for (int i = 0; i < 4; i++) {
        __m512 lo0 = _mm512_shuffle_f32x4(b[i], b[4 + i], _MM_SHUFFLE(2, 0, 2, 0));
        __m512 hi0 = _mm512_shuffle_f32x4(b[i], b[4 + i], _MM_SHUFFLE(3, 1, 3, 1));
        __m512 lo1 = _mm512_shuffle_f32x4(b[8 + i], b[12 + i], _MM_SHUFFLE(2, 0, 2, 0));
        __m512 hi1 = _mm512_shuffle_f32x4(b[8 + i], b[12 + i], _MM_SHUFFLE(3, 1, 3, 1));
        v[i] = _mm512_shuffle_f32x4(lo0, lo1, _MM_SHUFFLE(2, 0, 2, 0));
        v[8 + i] = _mm512_shuffle_f32x4(lo0, lo1, _MM_SHUFFLE(3, 1, 3, 1));
        v[4 + i] = _mm512_shuffle_f32x4(hi0, hi1, _MM_SHUFFLE(2, 0, 2, 0));
        v[12 + i] = _mm512_shuffle_f32x4(hi0, hi1, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* A member's row maxima folded over its stored scores of keys [from, to) (in L2 by now). */
ALWAYS_INLINE void fold_max(const Member *member, int64_t from, int64_t to, int heads) {
    for (int h = 0; h < heads; h++) {
        const float *row = member->scores + h * member->len;
        __m512 top = _mm512_set1_ps(-FLT_MAX);
        for (int64_t t = from; t < to; t += 16) {
            const __mmask16 keys = first_lanes16(to - t);
            top = _mm512_mask_max_ps(top, keys, top, _mm512_maskz_loadu_ps(keys, row + t));
        }
        member->max_score[h] = fmaxf(member->max_score[h], _mm512_reduce_max_ps(top));
    }
}

#endif
#endif
