/* Units of sequences that share blocks (decode_shared_blocks.h) on the AMX tile unit: the
 * shared keys' scores and the shared values' weighted sums as tile products, for all of a
 * unit's queries at once. Included by decode_shared_blocks.h; empty where the build has no
 * AMX. Defines AMX_UNITS when present.
 *
 * Why: on AMX CPUs the alternative was attending every member alone (its scores on the tile
 * unit, decode_scores_amx.h), each re-reading the shared K/V from L3 — 128 requests behind a
 * 1,500-token prompt are then bound by that traffic — or the unit's vector passes, which read
 * the shared blocks once but spend a VDPBF16PS per 16 queries and key pair on the scores and
 * a float32 FMA per 16 values and (query, key) on the sums. Here both are tile products:
 *   - scores: S^T[16 keys][16 queries] = K . Q^T, K's rows straight from the cache as the left
 *     tile, 16 of the unit's queries of one kv head packed once per unit as the right tile (the
 *     layout pack_unit_queries already makes for the lanes path); S^T is transposed into the
 *     members' score rows as the lanes path does.
 *   - sums: O[16 queries][16 dims] += P . V over 32 shared keys per product, P from the
 *     members' probabilities, V's rows interleaved by key pairs once per unit and kv head.
 *     P is a float32 softmax numerator; it is split into bf16 high and low parts, P = hi + lo
 *     up to 2^-17 of P, and both are multiplied (exact products, float32 sums), so the sums
 *     keep float32's precision instead of bf16's, and a member's output still differs from
 *     its output alone by at most one bf16 rounding, in a few values.
 *   - each member's own keys: S^T[16 keys][16 heads] against its own Q^T (score_own_amx),
 *     up to 32 heads. Its own values stay on the vector pass: that pass waits on memory (a
 *     member's own blocks are read once), and tile products would not bring them sooner.
 * Needs block_size % 16 == 0 and head_dim 64 or 128 (the tile shapes below).
 */
#ifndef PAGEDGEN_CPU_DECODE_SHARED_AMX_H
#define PAGEDGEN_CPU_DECODE_SHARED_AMX_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "decode_bf16_blocks.h"
#include "decode_bf16_passes.h"
#include "decode_scores_amx.h"
#include "decode_units.h"
#include "x86_common.h"

#define AMX_UNITS 1
#define UNIT_TILE_WORDS 256 /* 16 rows x 64 bytes */
/* Shared keys per pass of the sums: their V tiles (16 KB per 64 dims) and P tiles (16 KB) stay
 * in L1/L2 while every query tile of the unit runs past them. */
#define SEGMENT_KEYS 256

/* Scores of the shared keys against every member's queries into the members' score rows
 * (scaled, as score_keys writes them). Tiles: 0 scores; 1-4 K rows (32 dims each); 5, 6 Q^T. */
ALWAYS_INLINE void score_shared_amx(const Bf16Job *job, const Scratch *scratch, Unit unit,
                                    const Member *members, NextPass then, int DIM, int GROUP) {
    const int bs = job->block_size, pairs = DIM / 2, queries = unit.count * GROUP;
    const int vectors = (queries + 15) / 16;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM, row_bytes = stride * 2;
    const __m512 scale = _mm512_set1_ps(job->scale);
    const int64_t *table = job->block_tables + (int64_t)unit.first * job->max_blocks;
    float *tile = scratch->tile_out;
    pack_unit_queries(job, unit, scratch->unit_queries, DIM, GROUP);
    for (int64_t start = 0; start < unit.shared; start += bs) {
        const uint16_t *rows = block_rows(job, job->k_cache, table, start / bs, DIM);
        Prefetch fetch = prefetch_ahead_start(job, job->k_cache, table, start, unit.shared, then,
                                              DIM);
        const int64_t share =
            (fetch.left / ((bs / 16) * job->num_kv_heads * vectors) + 63) & ~(int64_t)63;
        for (int c = 0; c < bs; c += 16)
            for (int kv = 0; kv < job->num_kv_heads; kv++) {
                const uint16_t *chunk = rows + (int64_t)c * stride + kv * DIM;
                _tile_loadd(1, chunk, row_bytes);
                _tile_loadd(2, chunk + 32, row_bytes);
                if (DIM == 128) {
                    _tile_loadd(3, chunk + 64, row_bytes);
                    _tile_loadd(4, chunk + 96, row_bytes);
                }
                for (int v = 0; v < vectors; v++) {
                    prefetch_some(&fetch, share);
                    const uint32_t *packed =
                        scratch->unit_queries + ((int64_t)kv * vectors + v) * pairs * 16;
                    _tile_zero(0);
                    _tile_loadd(5, packed, 64);
                    _tile_dpbf16ps(0, 1, 5);
                    _tile_loadd(6, packed + UNIT_TILE_WORDS, 64);
                    _tile_dpbf16ps(0, 2, 6);
                    if (DIM == 128) {
                        _tile_loadd(5, packed + 2 * UNIT_TILE_WORDS, 64);
                        _tile_dpbf16ps(0, 3, 5);
                        _tile_loadd(6, packed + 3 * UNIT_TILE_WORDS, 64);
                        _tile_dpbf16ps(0, 4, 6);
                    }
                    _tile_stored(0, tile, 64);
                    __m512 dots[16]; /* key t against the 16 queries, then transposed */
                    for (int t = 0; t < 16; t++) dots[t] = _mm512_load_ps(tile + 16 * t);
                    transpose16(dots);
                    for (int r = 0; r < 16 && 16 * v + r < queries; r++) {
                        const int i = 16 * v + r;
                        const Member *member = &members[i / GROUP];
                        const int h = kv * GROUP + i % GROUP;
                        _mm512_storeu_ps(member->scores + h * member->len + start + c,
                                         _mm512_mul_ps(dots[r], scale));
                    }
                }
            }
    }
}

/* Whether a member's own keys are scored on tiles: its query heads fill at most two tiles of
 * 16 columns, each kv head's within one. */
static inline int own_keys_on_tiles(int heads, int group) {
    return heads <= 16 || (heads <= 32 && 16 % group == 0);
}

/* K rows A of this chunk (32 dims, I-th) times the member's Q^T tile I of kv head kv into C. */
#define OWN_PRODUCT(C, A, B, I)                                                         \
    do {                                                                                \
        _tile_loadd(A, chunk + kv * DIM + 32 * (I), row_bytes);                         \
        _tile_loadd(B, q_tiles + (I) * UNIT_TILE_WORDS, 64);                            \
        _tile_dpbf16ps(C, A, B);                                                        \
    } while (0)
#define OWN_PRODUCTS(C)                                                                 \
    do {                                                                                \
        OWN_PRODUCT(C, 2, 4, 0);                                                        \
        OWN_PRODUCT(C, 3, 5, 1);                                                        \
        if (DIM == 128) {                                                               \
            OWN_PRODUCT(C, 2, 4, 2);                                                    \
            OWN_PRODUCT(C, 3, 5, 3);                                                    \
        }                                                                               \
    } while (0)

/* A member's own keys [from, len) (from: a block's first key) against its query heads into its
 * score rows, scaled, as score_keys writes them: S^T[16 keys][16 heads] per column tile (heads
 * 0-15 in tile 0, 16-31 in tile 1), K rows from the cache as the left tiles, the member's Q^T
 * (pack_query_tiles' layout, columns h % 16) as the right ones; transposed into the rows.
 * Tiles: 0, 1 scores; 2, 3 K; 4, 5 Q^T. */
ALWAYS_INLINE void score_own_amx(const Bf16Job *job, const Scratch *scratch, const Member *member,
                                 int64_t from, NextPass then, int DIM, int GROUP) {
    const int bs = job->block_size, NV = DIM / 32, heads = job->num_q_heads;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM, row_bytes = stride * 2;
    const __m512 scale = _mm512_set1_ps(job->scale);
    float *tile = scratch->tile_out;
    pack_query_tiles(job, member->q, scratch->own_q_tiles, DIM, GROUP);
    for (int64_t start = from; start < member->len; start += bs) {
        const uint16_t *rows = block_rows(job, job->k_cache, member->table, start / bs, DIM);
        const int count = member->len - start < bs ? (int)(member->len - start) : bs;
        Prefetch fetch = prefetch_ahead_start(job, job->k_cache, member->table, start,
                                              member->len, then, DIM);
        const int64_t share =
            (fetch.left / ((count + 15) / 16 * job->num_kv_heads) + 63) & ~(int64_t)63;
        for (int c = 0; c < count; c += 16) {
            const uint16_t *chunk = rows + (int64_t)c * stride; /* rows past count: unused */
            _tile_zero(0);
            if (heads > 16) _tile_zero(1);
            for (int kv = 0; kv < job->num_kv_heads; kv++) {
                prefetch_some(&fetch, share);
                const uint32_t *q_tiles = scratch->own_q_tiles + kv * NV * UNIT_TILE_WORDS;
                if (kv * GROUP < 16)
                    OWN_PRODUCTS(0);
                else
                    OWN_PRODUCTS(1);
            }
            const __mmask16 valid = first_lanes16(count - c);
            for (int part = 0; part * 16 < heads; part++) {
                if (part == 0)
                    _tile_stored(0, tile, 64);
                else
                    _tile_stored(1, tile, 64);
                __m512 dots[16]; /* key t against 16 heads, then head r against 16 keys */
                for (int t = 0; t < 16; t++) dots[t] = _mm512_load_ps(tile + 16 * t);
                transpose16(dots);
                for (int r = 0; r < 16 && 16 * part + r < heads; r++) {
                    float *row = member->scores + (16 * part + r) * member->len;
                    _mm512_mask_storeu_ps(row + start + c, valid, _mm512_mul_ps(dots[r], scale));
                }
            }
        }
    }
}

#undef OWN_PRODUCTS
#undef OWN_PRODUCT

/* V rows of shared keys [from, from + keys) of kv head `kv` as right tiles: tile (s, j) row p,
 * word n = (V[32 s + 2 p][16 j + n], V[32 s + 2 p + 1][16 j + n]), zero past the last key.
 * `ahead`: the first of the rows the next call packs (the same keys' next kv head, or the
 * next keys' first), prefetched into L2 here, row for row; NULL for none. */
ALWAYS_INLINE void pack_value_tiles(const Bf16Job *job, const int64_t *table, int64_t from,
                                    int64_t keys, int kv, const uint16_t *const *ahead,
                                    uint32_t *tiles, int DIM) {
    const int bs = job->block_size, NJ = DIM / 16;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM;
    /* word n of the result: element n of the first row, then element n of the second */
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t run = 0; run < keys; run += 16) { /* 16 keys never straddle a block */
        const int64_t key = from + run;
        const uint16_t *rows = block_rows(job, job->v_cache, table, key / bs, DIM) +
                               (key % bs) * stride + kv * DIM;
        const uint16_t *next = ahead != NULL ? ahead[run / 16] : NULL;
        uint32_t *out = tiles + (run / 32) * NJ * UNIT_TILE_WORDS + (run % 32) / 2 * 16;
        for (int p = 0; p < 8; p++) {
            const uint16_t *first = rows + 2 * p * stride, *second = first + stride;
            if (next != NULL)
                for (int line = 0; line < DIM * 2; line += 64) {
                    _mm_prefetch((const char *)(next + 2 * p * stride) + line, _MM_HINT_T1);
                    _mm_prefetch((const char *)(next + (2 * p + 1) * stride) + line, _MM_HINT_T1);
                }
            for (int j = 0; j < NJ; j++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(first + 16 * j));
                const __m256i b = _mm256_loadu_si256((const __m256i *)(second + 16 * j));
                _mm512_store_si512(out + (j * 16 + p) * 16,
                                   _mm512_permutexvar_epi16(
                                       interleave,
                                       _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
            }
        }
    }
    if (keys % 32) /* the last step's second half: keys that are not there */
        for (int j = 0; j < NJ; j++)
            for (int p = 8; p < 16; p++)
                _mm512_store_si512(tiles + ((keys / 32 * NJ + j) * 16 + p) * 16,
                                   _mm512_setzero_si512());
}

/* Where each 16-key run of the next pack_value_tiles call starts (see `ahead` there), or 0
 * runs when this is the last. */
ALWAYS_INLINE int next_value_runs(const Bf16Job *job, const int64_t *table, int64_t from,
                                  int64_t shared, int kv, const uint16_t **ahead, int DIM) {
    const int bs = job->block_size;
    const int64_t stride = (int64_t)job->num_kv_heads * DIM;
    int64_t next_from = from;
    int next_kv = kv + 1;
    if (next_kv == job->num_kv_heads) {
        next_kv = 0;
        next_from = from + SEGMENT_KEYS;
    }
    if (next_from >= shared) return 0;
    const int64_t keys = shared - next_from < SEGMENT_KEYS ? shared - next_from : SEGMENT_KEYS;
    int runs = 0;
    for (int64_t run = 0; run < keys; run += 16, runs++) {
        const int64_t key = next_from + run;
        ahead[runs] = block_rows(job, job->v_cache, table, key / bs, DIM) + (key % bs) * stride +
                      next_kv * DIM;
    }
    for (int r = runs; r < SEGMENT_KEYS / 16; r++) ahead[r] = NULL;
    return runs;
}

/* Left tiles of the probabilities of query tile v of kv head kv over shared keys [from, from
 * + keys): tile 2 s the bf16 high parts of keys 32 s.., tile 2 s + 1 the low parts; row r is
 * query 16 v + r (zero past the unit's queries, and past the last key). */
ALWAYS_INLINE void pack_prob_tiles(const Member *members, Unit unit, int kv, int v, int64_t from,
                                   int64_t keys, uint16_t *tiles, int GROUP) {
    const int queries = unit.count * GROUP;
    for (int64_t t = 0; t < keys; t += 32) {
        uint16_t *hi = tiles + (t / 32) * 2 * UNIT_TILE_WORDS * 2, *lo = hi + UNIT_TILE_WORDS * 2;
        const __mmask16 first = first_lanes16(keys - t);
        for (int r = 0; r < 16; r++) {
            const int i = 16 * v + r;
            __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
            if (i < queries) {
                const Member *member = &members[i / GROUP];
                const float *probs =
                    member->scores + (kv * GROUP + i % GROUP) * member->len + from + t;
                p0 = _mm512_maskz_loadu_ps(first, probs);
                if (keys - t > 16)
                    p1 = _mm512_maskz_loadu_ps(first_lanes16(keys - t - 16), probs + 16);
            }
            const __m512i high = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
            const __m512 rest0 = _mm512_sub_ps(p0, bf16x16_widen(_mm512_castsi512_si256(high)));
            const __m512 rest1 =
                _mm512_sub_ps(p1, bf16x16_widen(_mm512_extracti64x4_epi64(high, 1)));
            _mm512_store_si512(hi + 32 * r, high);
            _mm512_store_si512(lo + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(rest1, rest0));
        }
    }
}

/* Output tile j (16 queries x 16 dims, at tile_out + 256 j) added into the members' sums. */
ALWAYS_INLINE void add_output_tile(const Member *members, Unit unit, int kv, int v, int dims,
                                   const float *tile, int DIM, int GROUP) {
    const int queries = unit.count * GROUP;
    for (int r = 0; r < 16 && 16 * v + r < queries; r++) {
        const int i = 16 * v + r;
        float *acc = members[i / GROUP].acc + (kv * GROUP + i % GROUP) * DIM + dims;
        _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc), _mm512_load_ps(tile + 16 * r)));
    }
}

/* O tile C += P (hi tile 4, lo tile 5) . V tile (loaded into B) of dims J of this step. */
#define WEIGH_DIMS(C, B, J)                                                   \
    do {                                                                      \
        _tile_loadd(B, values + (J) * UNIT_TILE_WORDS, 64);                   \
        _tile_dpbf16ps(C, 4, B);                                              \
        _tile_dpbf16ps(C, 5, B);                                              \
    } while (0)

/* The shared keys' values into every member's sums (what weigh_shared_values adds), SEGMENT_KEYS
 * keys at a time. Tiles: 0-3 sums of 64 dims; 4, 5 P's high and low parts; 6, 7 V. */
ALWAYS_INLINE void weigh_shared_amx(const Bf16Job *job, const Scratch *scratch, Unit unit,
                                    const Member *members, int DIM, int GROUP) {
    const int NJ = DIM / 16, vectors = (unit.count * GROUP + 15) / 16;
    const int64_t *table = job->block_tables + (int64_t)unit.first * job->max_blocks;
    float *out = scratch->tile_out;
    for (int64_t from = 0; from < unit.shared; from += SEGMENT_KEYS) {
        const int64_t keys = unit.shared - from < SEGMENT_KEYS ? unit.shared - from : SEGMENT_KEYS;
        const int steps = (int)((keys + 31) / 32);
        for (int kv = 0; kv < job->num_kv_heads; kv++) {
            const uint16_t *ahead[SEGMENT_KEYS / 16];
            const int runs = next_value_runs(job, table, from, unit.shared, kv, ahead, DIM);
            pack_value_tiles(job, table, from, keys, kv, runs ? ahead : NULL,
                             scratch->value_tiles, DIM);
            for (int v = 0; v < vectors; v++) {
                pack_prob_tiles(members, unit, kv, v, from, keys, scratch->prob_tiles, GROUP);
                for (int dims = 0; dims < DIM; dims += 64) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int s = 0; s < steps; s++) {
                        const uint16_t *probs = scratch->prob_tiles + s * 4 * UNIT_TILE_WORDS;
                        const uint32_t *values =
                            scratch->value_tiles + ((int64_t)s * NJ + dims / 16) * UNIT_TILE_WORDS;
                        _tile_loadd(4, probs, 64);
                        _tile_loadd(5, probs + 2 * UNIT_TILE_WORDS, 64);
                        WEIGH_DIMS(0, 6, 0);
                        WEIGH_DIMS(1, 7, 1);
                        WEIGH_DIMS(2, 6, 2);
                        WEIGH_DIMS(3, 7, 3);
                    }
                    _tile_stored(0, out, 64);
                    _tile_stored(1, out + UNIT_TILE_WORDS, 64);
                    _tile_stored(2, out + 2 * UNIT_TILE_WORDS, 64);
                    _tile_stored(3, out + 3 * UNIT_TILE_WORDS, 64);
                    for (int j = 0; j < 4; j++)
                        add_output_tile(members, unit, kv, v, dims + 16 * j,
                                        out + j * UNIT_TILE_WORDS, DIM, GROUP);
                }
            }
        }
    }
}

#undef WEIGH_DIMS
#endif
#endif
