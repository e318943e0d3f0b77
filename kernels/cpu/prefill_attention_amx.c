/* Causal attention of one prefill chunk on AMX tiles, flash-attention style (bfloat16).
 *
 * Why: torch's SDPA for bf16 on CPU runs far below what the tile unit does for the GEMMs of a
 * prefill, its softmax exp the largest part, and prefill attention was a large share of a long
 * prefill step of the default model (bench/FIGURES.md).
 *
 * The chunk's q_len queries sit at positions context_len - q_len .. context_len - 1 of a
 * sequence whose K/V (context_len tokens, the chunk's own included) are in the paged cache.
 * First K and V are packed, per kv head, into the tile unit's VNNI layout (K^T tiles of 16
 * keys x 32 dims, V tiles of 32 keys x 16 dims, zero past the context). Then each work item,
 * 16 query rows of up to 4 query heads sharing a kv head, walks the keys in blocks of 32 up to
 * its causal limit, each block through every head in turn:
 * S = Q K^T on tiles, an online softmax in float32 (exp written out, as in the decode kernel),
 * P rounded to bf16 (as GPU flash attention does) and O += P V on tiles, O rescaled in float32.
 * A sliding window (a row at p sees keys in (p - window, p]) starts each row block at its first
 * row's window and masks the keys before each row's own; keys before the chunk's first window
 * are never read (the hybrid cache may have freed their blocks) and pack as zeros.
 * Layouts: q rows q_stride elements apart, heads and head_dim contiguous (a view of the fused
 * QKV output); K/V cache [N, block_size, H_kv, D]; out contiguous [q_len, H_q, D].
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team_ops.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "x86_common.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define TILE_ELEMS 512 /* 16 rows x 64 bytes of bf16 */
#define KEYS 32        /* keys per step: two score tiles, one P tile */
#define MAX_DIM 256 /* Gemma 3's head_dim */
#define GROUP_HEADS 4 /* query heads of one kv head taken together (attend_rows) */

/* Tile use (configure_full_tiles): 0, 1 the scores of keys 0-15 and 16-31 (of the next key
 * block while this one's softmax runs), then with 2, 3 the P V products of 2 x 16 dims in
 * turns; 4: Q (per 32 dims); 5: P; 6, 7: K^T or V. */

typedef struct {
    const uint16_t *q, *k_cache, *v_cache;
    const int64_t *table;
    uint16_t *out;
    int64_t q_stride, context_len, q_len;
    int num_q_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int window;                 /* > 0: a row at p sees keys in (p - window, p]; 0: keys 0..p */
    int64_t first_key;          /* the chunk's first row's first key: none before it is read */
    int64_t first_block;        /* first_key / KEYS: the first packed key block */
    int64_t key_blocks;         /* ceil(context_len / KEYS) - first_block: blocks packed */
    uint16_t *k_tiles, *v_tiles; /* packed, per kv head */
} Chunk;

/* The first key a row at `pos` sees. */
ALWAYS_INLINE int64_t window_start(const Chunk *c, int64_t pos) {
    return c->window > 0 && pos >= c->window ? pos - c->window + 1 : 0;
}

/* Whether `key` is packed from the cache (else zero: past the context, or before the window
 * of the chunk's first row). */
ALWAYS_INLINE int key_read(const Chunk *c, int64_t key) {
    return key >= c->first_key && key < c->context_len;
}

ALWAYS_INLINE const uint16_t *cache_row(const Chunk *c, const uint16_t *cache, int64_t key, int kv) {
    const int64_t block = c->table[key / c->block_size], offset = key % c->block_size;
    return cache + ((block * c->block_size + offset) * c->num_kv_heads + kv) * c->head_dim;
}

/* K^T tile (kv, 16-key block b, 32-dim block i): row r, column n = the pair
 * K[16 b + n][32 i + 2 r], K[16 b + n][32 i + 2 r + 1]; zero where not read (key_read).
 * Blocks are numbered from key 0; only those from first_block on are stored. */
static uint16_t *k_tile(const Chunk *c, int kv, int64_t b, int i) {
    const int64_t per_head = c->key_blocks * 2 * (c->head_dim / 32);
    b -= 2 * c->first_block;
    return c->k_tiles + ((kv * per_head) + b * (c->head_dim / 32) + i) * TILE_ELEMS;
}

/* V tile (kv, 32-key block j, 16-dim block d): row r, column n = the pair
 * V[32 j + 2 r][16 d + n], V[32 j + 2 r + 1][16 d + n]. */
static uint16_t *v_tile(const Chunk *c, int kv, int64_t j, int d) {
    const int64_t per_head = c->key_blocks * (c->head_dim / 16);
    j -= c->first_block;
    return c->v_tiles + ((kv * per_head) + j * (c->head_dim / 16) + d) * TILE_ELEMS;
}

static void pack_keys(const Chunk *c, int kv, int64_t j) {
    for (int64_t half = 0; half < 2; half++) {
        const int64_t b = 2 * j + half;
        for (int i = 0; i < c->head_dim / 32; i++) {
            uint32_t *tile = (uint32_t *)k_tile(c, kv, b, i);
            for (int n = 0; n < 16; n++) {
                const int64_t key = 16 * b + n;
                if (!key_read(c, key)) {
                    for (int r = 0; r < 16; r++) tile[r * 16 + n] = 0;
                    continue;
                }
                const uint16_t *row = cache_row(c, c->k_cache, key, kv) + 32 * i;
                for (int r = 0; r < 16; r++) memcpy(tile + r * 16 + n, row + 2 * r, 4);
            }
        }
    }
}

static void pack_values(const Chunk *c, int kv, int64_t j) {
    static const uint16_t zeros[MAX_DIM];
    for (int r = 0; r < 16; r++) {
        const int64_t key = KEYS * j + 2 * r;
        const uint16_t *even = key_read(c, key) ? cache_row(c, c->v_cache, key, kv) : zeros;
        const uint16_t *odd = key_read(c, key + 1) ? cache_row(c, c->v_cache, key + 1, kv) : zeros;
        for (int d = 0; d < c->head_dim / 16; d++) {
            uint16_t *tile = v_tile(c, kv, j, d) + r * 32;
            for (int n = 0; n < 16; n++) {
                tile[2 * n] = even[16 * d + n];
                tile[2 * n + 1] = odd[16 * d + n];
            }
        }
    }
}

/* 2^x for x <= 0 as exp2_nonpositive (x86_common.h), with the degree-4 Taylor polynomial:
 * relative error below 1e-4, 20 times under the bf16 rounding every weight then takes for the
 * tile product, for two FMAs fewer per vector. */
ALWAYS_INLINE __m512 exp2_weight(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.6181291076284772e-3f);                   /* ln2^4 / 24 */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108664821580e-2f)); /* ln2^3 / 6 */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650695910071e-1f)); /* ln2^2 / 2 */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718055994531e-1f)); /* ln2 */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Running state of 16 query rows: output sums, row maxima (raw scores) and the sums of p
 * (kept as 16 partial sums per row, added up at the end). */
typedef struct {
    float out[16][MAX_DIM];
    float max[16];
    __m512 sum[16];
} RowState;

/* scores [16][32] (raw) of the key block starting at `key0` -> P (bf16) for the tile, with the
 * causal mask (key <= position of the row) where the block reaches past the first row's
 * position and the window's (key > position - window) where one is set, and the
 * online-softmax update of the row state; rescale[r]: the factor for the row's old output
 * sums. A row may see none of a block's keys: its P row is zero and its state unchanged. */
ALWAYS_INLINE void softmax_step(float (*scores)[KEYS], int64_t key0, int64_t first_pos,
                                int window, float scale, RowState *state, uint16_t (*p)[KEYS],
                                float *rescale) {
    const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 factor = _mm512_set1_ps(scale);
    /* exp(scale (s - max)) = 2^(s log2e scale - max log2e scale): one FMA before exp2 */
    const float log2_factor = scale * 1.44269504f;
    const __m512 factor2 = _mm512_set1_ps(log2_factor), floor2 = _mm512_set1_ps(-126.0f);
    const int masked = key0 + KEYS - 1 > first_pos || window > 0;
    float old_max[16];
    __m512 block_sum[16];
    for (int r = 0; r < 16; r++) {
        __m512 s0 = _mm512_loadu_ps(scores[r]), s1 = _mm512_loadu_ps(scores[r] + 16);
        __mmask16 keep0 = 0xffff, keep1 = 0xffff;
        if (masked) {
            const __m512 limit = _mm512_set1_ps((float)(first_pos + r - key0));
            keep0 = _mm512_cmp_ps_mask(lanes, limit, _CMP_LE_OQ);
            keep1 = _mm512_cmp_ps_mask(_mm512_add_ps(lanes, _mm512_set1_ps(16.0f)), limit,
                                       _CMP_LE_OQ);
            if (window > 0) {  /* key0 + k > first_pos + r - window */
                const __m512 start = _mm512_sub_ps(limit, _mm512_set1_ps((float)window));
                keep0 &= _mm512_cmp_ps_mask(lanes, start, _CMP_GT_OQ);
                keep1 &= _mm512_cmp_ps_mask(_mm512_add_ps(lanes, _mm512_set1_ps(16.0f)), start,
                                            _CMP_GT_OQ);
            }
            s0 = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), keep0, s0);
            s1 = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), keep1, s1);
        }
        /* the row's maximum moves only where a score passes it: a compare, and the
         * horizontal reduction only then (after the first blocks, rarely) */
        old_max[r] = state->max[r];
        const __m512 top = _mm512_max_ps(s0, s1);
        float new_max = old_max[r];
        if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(old_max[r]), _CMP_GT_OQ))
            new_max = _mm512_reduce_max_ps(top);
        state->max[r] = new_max;
        /* masked lanes (-FLT_MAX) and a row without keys yet meet the floor, not -inf */
        const __m512 m2 = _mm512_set1_ps(new_max * log2_factor);
        __m512 e0 = _mm512_maskz_mov_ps(
            keep0, exp2_weight(_mm512_max_ps(_mm512_fmsub_ps(s0, factor2, m2), floor2)));
        __m512 e1 = _mm512_maskz_mov_ps(
            keep1, exp2_weight(_mm512_max_ps(_mm512_fmsub_ps(s1, factor2, m2), floor2)));
        block_sum[r] = _mm512_add_ps(e0, e1);
        _mm256_storeu_si256((__m256i *)p[r], (__m256i)_mm512_cvtneps_pbh(e0));
        _mm256_storeu_si256((__m256i *)(p[r] + 16), (__m256i)_mm512_cvtneps_pbh(e1));
    }
    /* all 16 rows' factors exp(scale (old - new)) in one vector; 0 before any key (old -inf) */
    __m512 old = _mm512_loadu_ps(old_max), now = _mm512_loadu_ps(state->max);
    __m512 alpha = exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(old, now), factor));
    alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(old, _mm512_set1_ps(-FLT_MAX), _CMP_NEQ_OQ),
                                alpha);
    _mm512_storeu_ps(rescale, alpha);
    for (int r = 0; r < 16; r++)
        state->sum[r] = _mm512_fmadd_ps(state->sum[r], _mm512_set1_ps(rescale[r]), block_sum[r]);
}

/* Tiles 0, 1 = the raw scores Q K^T of the key block j (keys 32 j .. 32 j + 31) for the 16
 * query rows in q; tile 4 takes Q (per 32 dims), 6 and 7 K^T. */
ALWAYS_INLINE void score_tiles(const Chunk *c, int kv, uint16_t (*q)[MAX_DIM], int64_t j) {
    _tile_zero(0);
    _tile_zero(1);
    for (int i = 0; i < c->head_dim / 32; i++) {
        _tile_loadd(4, &q[0][32 * i], MAX_DIM * 2);
        _tile_loadd(6, k_tile(c, kv, 2 * j, i), 64);
        _tile_loadd(7, k_tile(c, kv, 2 * j + 1, i), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
}

/* P V for dims 32 r .. 32 r + 31 of key block j (P in tile 5, V tiles 6, 7) into tiles 2, 3
 * (r even) or 0, 1 (r odd), issued without waiting for them. */
ALWAYS_INLINE void issue_values(const Chunk *c, int kv, int64_t j, int r) {
    const uint16_t *low = v_tile(c, kv, j, 2 * r), *high = v_tile(c, kv, j, 2 * r + 1);
    if (r % 2 == 0) {
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(6, low, 64);
        _tile_loadd(7, high, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(6, low, 64);
        _tile_loadd(7, high, 64);
        _tile_dpbf16ps(0, 5, 6);
        _tile_dpbf16ps(1, 5, 7);
    }
}

/* out = out * rescale + the products issue_values(r) put in its tiles, in float32. */
ALWAYS_INLINE void add_values_of(int r, const float *rescale, RowState *state) {
    float pv[16][32];
    if (r % 2 == 0) {
        _tile_stored(2, pv[0], 32 * 4);
        _tile_stored(3, pv[0] + 16, 32 * 4);
    } else {
        _tile_stored(0, pv[0], 32 * 4);
        _tile_stored(1, pv[0] + 16, 32 * 4);
    }
    for (int row = 0; row < 16; row++) {
        const __m512 alpha = _mm512_set1_ps(rescale[row]);
        for (int e = 0; e < 2; e++) {
            float *o = state->out[row] + 32 * r + 16 * e;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), alpha,
                                                _mm512_loadu_ps(pv[row] + 16 * e)));
        }
    }
}

/* out = out * rescale + P V for the key block j, P in tile 5; tiles 0-3 free. Each 32 dims'
 * products are issued before the previous 32 dims' are stored and added: storing a product
 * right after issuing it waited for the tile unit every time. */
ALWAYS_INLINE void add_values(const Chunk *c, int kv, int64_t j, const float *rescale,
                              RowState *state) {
    const int rounds = c->head_dim / 32;
    issue_values(c, kv, j, 0);
    for (int r = 1; r < rounds; r++) {
        issue_values(c, kv, j, r);
        add_values_of(r - 1, rescale, state);
    }
    add_values_of(rounds - 1, rescale, state);
}

/* 16 query rows (from `row0` of the chunk) of `heads` query heads from `head0`, all of one kv
 * head. Each key block is taken by every head in turn before the next block, so that its K
 * and V tiles come from L2 for the first head and from L1 for the others: one head at a time,
 * walking all the keys, each tile was loaded from L2 once per head, and those loads were the
 * largest part of the time. Steps are (key block, head) in that order; the tile unit computes
 * the next step's scores (tiles 0, 1) before the softmax of this one, so that the two
 * overlap: in program order one after the other, every step waited on the tile unit's
 * latency and the vector units on it. */
static void attend_rows(const Chunk *c, int head0, int heads, int64_t row0, RowState *states) {
    const int kv = head0 / (c->num_q_heads / c->num_kv_heads);
    const int64_t rows = c->q_len - row0 < 16 ? c->q_len - row0 : 16;
    const int64_t first_pos = c->context_len - c->q_len + row0;
    /* the query blocks, zero-padded: tile loads read all 16 rows */
    uint16_t q[GROUP_HEADS][16][MAX_DIM];
    for (int h = 0; h < heads; h++) {
        memset(q[h], 0, sizeof q[h]);
        for (int64_t r = 0; r < rows; r++)
            memcpy(q[h][r], c->q + (row0 + r) * c->q_stride + (int64_t)(head0 + h) * c->head_dim,
                   (size_t)c->head_dim * 2);
        for (int r = 0; r < 16; r++) {
            states[h].max[r] = -FLT_MAX;
            states[h].sum[r] = _mm512_setzero_ps();
            memset(states[h].out[r], 0, sizeof(float) * c->head_dim);
        }
    }
    float scores[2][16][KEYS], rescale[16];
    uint16_t p[16][KEYS];
    /* from the first row's first visible key to the last row's causal limit */
    const int64_t first = window_start(c, first_pos) / KEYS, last = (first_pos + rows - 1) / KEYS;
    const int64_t steps = (last - first + 1) * heads;
    score_tiles(c, kv, q[0], first);
    _tile_stored(0, &scores[0][0][0], KEYS * 4);
    _tile_stored(1, &scores[0][0][16], KEYS * 4);
    for (int64_t step = 0; step < steps; step++) {
        const int64_t j = first + step / heads, after = step + 1;
        const int h = (int)(step % heads);
        float (*now)[KEYS] = scores[step & 1], (*next)[KEYS] = scores[after & 1];
        if (after < steps) score_tiles(c, kv, q[after % heads], first + after / heads);
        softmax_step(now, KEYS * j, first_pos, c->window, c->scale, &states[h], p, rescale);
        if (after < steps) {  /* tiles 0 and 1 free for the products */
            _tile_stored(0, &next[0][0], KEYS * 4);
            _tile_stored(1, &next[0][16], KEYS * 4);
        }
        _tile_loadd(5, p, KEYS * 2);
        add_values(c, kv, j, rescale, &states[h]);
    }
    for (int h = 0; h < heads; h++)
        for (int64_t r = 0; r < rows; r++) {
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(states[h].sum[r]));
            uint16_t *dst = c->out + ((row0 + r) * c->num_q_heads + head0 + h) * c->head_dim;
            for (int d = 0; d < c->head_dim / 16; d++)
                _mm256_storeu_si256((__m256i *)(dst + 16 * d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                        _mm512_loadu_ps(states[h].out[r] + 16 * d), inv)));
        }
}

int prefill_attention_supported(int num_q_heads, int num_kv_heads, int head_dim) {
    return head_dim % 64 == 0 && head_dim > 0 && head_dim <= MAX_DIM && num_kv_heads > 0 &&
           num_q_heads % num_kv_heads == 0 && amx_available();
}

/* Returns 0 when done, 1 when unsupported or out of memory (then use SDPA, which writes every
 * row of out again). */
int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int64_t *table, int64_t context_len,
                           int64_t q_len, uint16_t *out, int num_q_heads, int num_kv_heads,
                           int head_dim, int block_size, float scale, int sliding_window,
                           int num_threads) {
    if (!prefill_attention_supported(num_q_heads, num_kv_heads, head_dim) || q_len < 1 ||
        q_len > context_len || sliding_window < 0)
        return 1;
    Chunk c = {q, k_cache, v_cache, table, out, q_stride, context_len, q_len, num_q_heads,
               num_kv_heads, head_dim, block_size, scale, sliding_window, 0, 0, 0, NULL, NULL};
    c.first_key = window_start(&c, context_len - q_len);
    c.first_block = c.first_key / KEYS;
    c.key_blocks = (context_len + KEYS - 1) / KEYS - c.first_block;
    const size_t tiles = (size_t)num_kv_heads * c.key_blocks * 2 * (head_dim / 32);
    c.k_tiles = aligned_alloc(64, tiles * TILE_ELEMS * 2);
    c.v_tiles = aligned_alloc(64, tiles * TILE_ELEMS * 2); /* same count: KEYS x 16 dims */
    if (c.k_tiles == NULL || c.v_tiles == NULL) {
        free(c.k_tiles);
        free(c.v_tiles);
        return 1;
    }
    const int group = num_q_heads / num_kv_heads, parts = (group + GROUP_HEADS - 1) / GROUP_HEADS;
    const int64_t row_blocks = (q_len + 15) / 16, items = row_blocks * num_kv_heads * parts;
    int failed = 0; /* a thread without its row state: rows left unwritten, so report it */
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_kv_heads * c.key_blocks; item++) {
            pack_keys(&c, (int)(item / c.key_blocks), c.first_block + item % c.key_blocks);
            pack_values(&c, (int)(item / c.key_blocks), c.first_block + item % c.key_blocks);
        }
        configure_full_tiles();
        RowState *states = aligned_alloc(64, sizeof(RowState) * GROUP_HEADS);
        if (states == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* One kv head after another, so that the threads read its packed K/V (a few MB at
         * long contexts) from their L2 for all its query heads and rows, rather than from L3
         * for each item in turn; within one, the last query rows, which see the most keys,
         * first. An item: 16 rows of up to GROUP_HEADS of the kv head's query heads. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t kv = item / (row_blocks * parts), rest = item % (row_blocks * parts);
            const int part = (int)(rest % parts), head0 = (int)kv * group + part * GROUP_HEADS;
            const int heads = group - part * GROUP_HEADS < GROUP_HEADS
                                  ? group - part * GROUP_HEADS : GROUP_HEADS;
            if (states != NULL)
                attend_rows(&c, head0, heads, 16 * (row_blocks - 1 - rest / parts), states);
        }
        free(states);
        _tile_release();
    }
    free(c.k_tiles);
    free(c.v_tiles);
    return failed;
}

#else /* no AMX at build time: SDPA does it */

int prefill_attention_supported(int num_q_heads, int num_kv_heads, int head_dim) { return 0; }
int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int64_t *table, int64_t context_len,
                           int64_t q_len, uint16_t *out, int num_q_heads, int num_kv_heads,
                           int head_dim, int block_size, float scale, int sliding_window,
                           int num_threads) {
    return 1;
}

#endif
