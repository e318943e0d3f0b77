/* The bf16 tile GEMM of the AVX-512 BF16 library: for bf16 activations from a few rows on.
 *
 * Why: the int kernel (gguf_registers.c) pays a conversion and an FMA on 16 float lanes per
 * 32-block for every (weight row, activation row) pair, three to seven times the bf16 GEMM's
 * time on dequantized weights once a step has more than a handful of rows. Here a tile of
 * BF16_TILE_ROWS weight rows is decoded once to bf16 (decode_row_values: gguf's own float32 values,
 * rounded to nearest even, i.e. exactly what the dequantized bf16 path holds), into a buffer
 * that stays in L1/L2, and every activation row then runs past it with one VDPBF16PS per
 * 32-block: the arithmetic of the dense bf16 GEMM, with the weight read as stored. The result
 * is the dequantized bf16 path's product up to float32 summation order.
 *
 * A pass keeps BF16_PASS_ROWS x BF16_BATCH accumulators of 16 partial sums each (lanes along K);
 * one shuffle-and-add tree turns the 16 of them into the 16 outputs.
 *
 * The float32 form, where VDPBF16PS multiplies slower than float32 FMAs (timed once,
 * x86_common.h; Intel Xeons without usable AMX): the bf16 pairs of the tile and of the
 * activations are split in registers into their even and odd values widened to float32 (a
 * shift and a mask), and each product is an FMA: the same exact products as VDPBF16PS's,
 * summed in another order.
 *
 * From panel_min_rows() rows on, both forms take panel tiles instead: rows decoded the same
 * way, packed into the dense GEMM's layout and run through its own micro-tiles of the same
 * form (gemm_micro_tiles.h), which broadcast the activations rather than reduce sums across
 * lanes, and so give the dense GEMM's bits on the dequantized weight. They serve every row
 * count up to the dense GEMM's own limit: each weight is decoded once per call into a panel
 * that stays in L2, where dequantizing the whole weight for the dense GEMM wrote it to fresh
 * memory and packed it again (bench/GGUF_FIGURES.md).
 */
#include "../gemm_micro_tiles.h"
#include "../x86_common.h"

/* Which form the tiles take: -1 until first asked, then as timed (or as set for tests). */
static int tiles_form_in_use = -1;

/* 0: VDPBF16PS, 1: float32 FMA (choose_form's protocol, x86_common.h). */
int gguf_bf16_tiles_form(int form) { return choose_form(&tiles_form_in_use, form); }

/* Every pass streams its activation rows past the tile, from L2 once there are more of them
 * than L1 holds: eight weight rows per pass halve that traffic against four (4 x 4 was up to
 * 1.4x slower from 16 rows on, bench/GGUF_FIGURES.md; 16 x 1 slower everywhere). -D
 * overrides, for trying other shapes. */
#ifndef BF16_PASS_ROWS
#define BF16_PASS_ROWS 8  /* weight rows per pass */
#endif
#ifndef BF16_BATCH
#define BF16_BATCH 2      /* activation rows per pass: 8 x 2 = 16 accumulators */
#endif
_Static_assert(BF16_PASS_ROWS * BF16_BATCH == 16, "one pass reduces 16 accumulators");
/* Weight rows decoded per tile: 16 float32 outputs are one 64-byte line of each output row.
 * With 8, each line was written in two parts a whole pass over the weight apart (an LM head's
 * output rows are a megabyte long), which cost more than the arithmetic. */
#define BF16_TILE_ROWS 16
#define BF16_HALVES (BF16_TILE_ROWS / BF16_PASS_ROWS)
#define TILE_L1_BYTES (24 << 10)  /* a decoded tile this small stays in L1 (32-48 KiB) */

/* 16 vectors -> one vector whose lane i is the sum of v[i]'s lanes: three levels of
 * shuffle-and-add (halves, quarters, then pairs within a quarter) instead of 16 reductions. */
static inline __m512 sum_lanes16(const __m512 v[16]) {
    __m512 halves[8], quarters[4];
    for (int i = 0; i < 8; i++)  /* [v2i: 8 sums | v2i+1: 8 sums] */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                  _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* quarter c: 4 sums of v[4i + c] */
        quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                    _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
    /* within each quarter: [q0, q1, q2, q3] pairwise, so quarter c, lane j = v[4j + c] */
    __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(quarters[0], quarters[1]),
                             _mm512_unpackhi_ps(quarters[0], quarters[1]));
    __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2], quarters[3]),
                             _mm512_unpackhi_ps(quarters[2], quarters[3]));
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
    /* lane 4c + j holds v[4j + c]: put lane i at v[i] */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, sums);
}

/* BF16_PASS_ROWS decoded weight rows (rows of `tile`, k apart) against `batch` activation rows:
 * y[m * y_stride + r] for the first `rows` of them. */
static inline __attribute__((always_inline)) void bf16_pass(int batch, const uint16_t *tile,
                                                           const uint16_t *x, int64_t x_stride,
                                                           int64_t k, int rows, float *y,
                                                           int64_t y_stride) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t at = 0; at < k; at += 32) {
        __m512bh w[BF16_PASS_ROWS];
        for (int r = 0; r < BF16_PASS_ROWS; r++)
            w[r] = (__m512bh)_mm512_loadu_si512(tile + r * k + at);
        for (int m = 0; m < batch; m++) {
            __m512bh v = (__m512bh)_mm512_loadu_si512(x + m * x_stride + at);
            for (int r = 0; r < BF16_PASS_ROWS; r++)
                acc[m * BF16_PASS_ROWS + r] = _mm512_dpbf16_ps(acc[m * BF16_PASS_ROWS + r], w[r], v);
        }
    }
    float sums[16];
    _mm512_storeu_ps(sums, sum_lanes16(acc));
    for (int m = 0; m < batch; m++)
        for (int r = 0; r < rows; r++) y[m * y_stride + r] = sums[m * BF16_PASS_ROWS + r];
}

/* The float32 form's pass: WIDE_PASS_ROWS rows of the decoded tile against `batch` activation
 * rows, per 32 inputs each weight row's and activation row's bf16 pairs split in registers into
 * their even and odd values, widened (a shift, a mask), then two FMAs per pair of rows. Four
 * by four: each split weight vector serves four activation rows (eight by two split each
 * weight vector for two, and widening a tile into a float32 buffer first doubled the bytes
 * every pass streams: both measured slower). */
#define WIDE_PASS_ROWS 4
#define WIDE_BATCH 4
static inline __attribute__((always_inline)) void wide_pass(int batch, const uint16_t *btile,
                                                           const uint16_t *x, int64_t x_stride,
                                                           int64_t k, int rows, float *y,
                                                           int64_t y_stride) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t at = 0; at < k; at += 32) {
        __m512 even_x[WIDE_BATCH], odd_x[WIDE_BATCH];
        for (int m = 0; m < batch; m++) {
            const __m512i v = _mm512_loadu_si512(x + m * x_stride + at);
            even_x[m] = bf16_pairs_even(v);
            odd_x[m] = bf16_pairs_odd(v);
        }
        for (int r = 0; r < WIDE_PASS_ROWS; r++) {
            const __m512i wv = _mm512_loadu_si512(btile + r * k + at);
            const __m512 even_w = bf16_pairs_even(wv), odd_w = bf16_pairs_odd(wv);
            for (int m = 0; m < batch; m++)
                acc[m * WIDE_PASS_ROWS + r] =
                    _mm512_fmadd_ps(odd_w, odd_x[m],
                                    _mm512_fmadd_ps(even_w, even_x[m], acc[m * WIDE_PASS_ROWS + r]));
        }
    }
    float sums[16];
    _mm512_storeu_ps(sums, sum_lanes16(acc));
    for (int m = 0; m < batch; m++)
        for (int r = 0; r < rows; r++) y[m * y_stride + r] = sums[m * WIDE_PASS_ROWS + r];
}

static inline int kept_in_half(int rows, int half) {
    int kept = rows - half * BF16_PASS_ROWS;
    return kept < 0 ? 0 : kept < BF16_PASS_ROWS ? kept : BF16_PASS_ROWS;
}

/* `batch` activation rows through both halves of a decoded tile of which `rows` are kept
 * (the rest stood in for rows past the weight's end). */
static inline __attribute__((always_inline)) void batch_through_tile(
        int batch, const uint16_t *tile, const uint16_t *x, int64_t x_stride, int64_t k, int rows,
        float *y, int64_t y_stride) {
    for (int half = 0; half < BF16_HALVES; half++)
        if (kept_in_half(rows, half))
            bf16_pass(batch, tile + half * BF16_PASS_ROWS * k, x, x_stride, k,
                      kept_in_half(rows, half), y + half * BF16_PASS_ROWS, y_stride);
}

/* Activation rows x[0..m_rows) against a tile: batch by batch through the whole tile when it
 * fits L1 (fewer, shorter trips through x), else half by half, each half (which does fit)
 * through every row. Either way the second half completes each output line soon after the
 * first wrote its part. */
static void rows_through_tile(int whole_tile_in_l1, const uint16_t *tile, const uint16_t *x,
                              int64_t x_stride, int64_t m_rows, int64_t k, int rows, float *y,
                              int64_t y_stride, int wide) {
    if (wide) { /* the float32 form: four weight rows at a time through every activation row */
        for (int first = 0; first < rows; first += WIDE_PASS_ROWS) {
            const int kept = rows - first < WIDE_PASS_ROWS ? rows - first : WIDE_PASS_ROWS;
            const uint16_t *part = tile + first * k;
            float *out = y + first;
            int64_t m0 = 0;
            for (; m0 + WIDE_BATCH <= m_rows; m0 += WIDE_BATCH)
                wide_pass(WIDE_BATCH, part, x + m0 * x_stride, x_stride, k, kept,
                          out + m0 * y_stride, y_stride);
#define REST(B) wide_pass(B, part, x + m0 * x_stride, x_stride, k, kept, out + m0 * y_stride, y_stride)
            switch (m_rows - m0) { /* the rest, each count its own copy of the loop */
            case 1: REST(1); break;
            case 2: REST(2); break;
            case 3: REST(3); break;
            default: break;
            }
#undef REST
        }
        return;
    }
    for (int half = 0; half < (whole_tile_in_l1 ? 1 : BF16_HALVES); half++) {
        const uint16_t *part = whole_tile_in_l1 ? tile : tile + half * BF16_PASS_ROWS * k;
        int kept = whole_tile_in_l1 ? rows : kept_in_half(rows, half);
        float *out = whole_tile_in_l1 ? y : y + half * BF16_PASS_ROWS;
        if (kept == 0) break;
        int64_t m0 = 0;
#define THROUGH(batch, at)                                                                      \
        if (whole_tile_in_l1)                                                                   \
            batch_through_tile(batch, part, x + (at) * x_stride, x_stride, k, kept,             \
                               out + (at) * y_stride, y_stride);                                \
        else                                                                                    \
            bf16_pass(batch, part, x + (at) * x_stride, x_stride, k, kept, out + (at) * y_stride, \
                      y_stride)
        for (; m0 + BF16_BATCH <= m_rows; m0 += BF16_BATCH) { THROUGH(BF16_BATCH, m0); }
        /* the rest, each count its own copy of the loop */
        int rest = (int)(m_rows - m0);
        if (rest == 1) { THROUGH(1, m0); }
#if BF16_BATCH > 2
        else if (rest == 2) { THROUGH(2, m0); }
#endif
#if BF16_BATCH > 3
        else if (rest == 3) { THROUGH(3, m0); }
#endif
#undef THROUGH
    }
}

/* ---- panel tiles: weight rows decoded into the dense GEMM's packed layout ---------------- */

/* Weight rows per panel tile: the dense GEMM's micro-tile width, three 16-row blocks. */
#define PANEL_ROWS (16 * MICRO_TILE_BLOCKS)
/* Panel tiles from this many activation rows: packing the decoded rows pays from about there,
 * sooner for short rows (K up to PANEL_SHORT_K, where 16 rows gained and K = 2048 did not;
 * bench/GGUF_FIGURES.md). */
#ifndef PANEL_MIN_ROWS
#define PANEL_MIN_ROWS 24
#endif
#define PANEL_MIN_ROWS_SHORT_K 16
#define PANEL_SHORT_K 1024

static int panel_min_rows(int64_t k) {
    return k <= PANEL_SHORT_K ? PANEL_MIN_ROWS_SHORT_K : PANEL_MIN_ROWS;
}

/* A micro-tile's float32 sums -> y: rows r < R, blocks c < C, of the last block only its first
 * last_cols columns (the rest stood in for rows past the weight's end). */
static inline __attribute__((always_inline)) void store_sums(MicroTileSums acc, float *y,
                                                            int64_t y_stride, int R, int C,
                                                            int last_cols) {
    const __mmask16 last = (__mmask16)((1u << last_cols) - 1);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            _mm512_mask_storeu_ps(y + r * y_stride + c * 16, c == C - 1 ? last : 0xFFFF,
                                  acc[r][c]);
}

/* 16 floats rounded to bf16 (nearest even) and widened back: gguf_gemm's round_to_bf16. */
static inline __attribute__((always_inline)) __m512 rounded_to_bf16(__m512 values) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(values)), 16));
}

/* y[m, 0..cols) for m < m_rows rounded to bf16 in place, kept in float32: applied to a
 * tile's outputs while they are in cache. */
static void round_tile_outputs(float *y, int64_t y_stride, int64_t m_rows, int cols) {
    for (int64_t m = 0; m < m_rows; m++)
        for (int c = 0; c < cols; c += 16) {
            const __mmask16 lanes = cols - c >= 16 ? 0xFFFF : (__mmask16)((1u << (cols - c)) - 1);
            float *at = y + m * y_stride + c;
            _mm512_mask_storeu_ps(at, lanes, rounded_to_bf16(_mm512_maskz_loadu_ps(lanes, at)));
        }
}

/* Every activation row against C packed blocks (panel), micro-tile by micro-tile: in the
 * float32 form where `wide` holds the rows widened, else with VDPBF16PS on the bf16 rows. */
static inline __attribute__((always_inline)) void rows_through_panel(
        WidenedRows wide, const uint16_t *x, int64_t x_stride, const uint16_t *panel, int64_t pairs,
        int64_t m_rows, float *y, int64_t y_stride, int C, int last_cols) {
    for (int64_t row = 0; row < m_rows; row += MICRO_TILE_ROWS) {
        const int R = m_rows - row < MICRO_TILE_ROWS ? (int)(m_rows - row) : MICRO_TILE_ROWS;
        const int64_t next = row + R, ahead = m_rows - next < MICRO_TILE_ROWS ? m_rows - next
                                                                                 : MICRO_TILE_ROWS;
        if (m_rows >= PREFETCH_OUT_MIN_ROWS && ahead > 0)
            prefetch_for_write(y + next * y_stride, y_stride * 4, ahead, (int64_t)C * 16 * 4);
        const float *x_wide =
            wide.data ? widened_rows_at(wide, x, x_stride, row, R, 2 * pairs) : NULL;
        MicroTileSums acc;
#define SUMS(R_)                                                                          \
        if (x_wide)                                                                       \
            wide_tile_sums(x_wide, panel, NULL, pairs, R_, C, acc);                       \
        else                                                                              \
            bf16_tile_sums(x + row * x_stride, x_stride, panel, NULL, pairs, R_, C, acc); \
        store_sums(acc, y + row * y_stride, y_stride, R_, C, last_cols)
        switch (R) { /* constant R: the sums stay in registers */
        case 1: SUMS(1); break;
        case 2: SUMS(2); break;
        case 3: SUMS(3); break;
        case 4: SUMS(4); break;
        case 5: SUMS(5); break;
        case 6: SUMS(6); break;
        case 7: SUMS(7); break;
        default: SUMS(MICRO_TILE_ROWS); break;
        }
#undef SUMS
    }
}

static void rows_through_full_panel(WidenedRows wide, const uint16_t *x, int64_t x_stride,
                                    const uint16_t *panel, int64_t pairs, int64_t m_rows, float *y,
                                    int64_t y_stride, int last_cols) {
    rows_through_panel(wide, x, x_stride, panel, pairs, m_rows, y, y_stride, MICRO_TILE_BLOCKS,
                       last_cols);
}

/* A narrower last tile (the weight's rows not a multiple of PANEL_ROWS): one block at a time. */
static void rows_through_block(WidenedRows wide, const uint16_t *x, int64_t x_stride,
                               const uint16_t *panel, int64_t pairs, int64_t m_rows, float *y,
                               int64_t y_stride, int last_cols) {
    rows_through_panel(wide, x, x_stride, panel, pairs, m_rows, y, y_stride, 1, last_cols);
}

/* bf16_tiles_team's contract with tiles of PANEL_ROWS weight rows decoded to bf16 (16 rows at
 * a time through a row buffer in L1) and packed into the dense GEMM's layout, then every
 * activation row run through them by its micro-tiles, in the float32 form where `widen`: the
 * dense GEMM's arithmetic on the dequantized weight, so the same sums, with the weight read
 * as stored. */
static int panel_tiles_team(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                            int64_t n_rows, int64_t k, const uint16_t *x, int64_t x_stride,
                            int64_t m_rows, float *y, int64_t y_stride, int round_to_bf16,
                            int widen) {
    const int64_t pairs = k / 2, panel_elems = pairs * GEMM_PAIR_ELEMS;
    uint16_t *rows16 = aligned_alloc(64, sizeof(uint16_t) * (size_t)(16 * k));
    uint16_t *panel = aligned_alloc(64, sizeof(uint16_t) * (size_t)(PANEL_ROWS * k));
    const WidenedRows wide = widen ? widened_rows_new(x, x_stride, m_rows, k)
                                   : (WidenedRows){NULL, 0};
    const int ok = rows16 != NULL && panel != NULL && (!widen || wide.data != NULL);
#pragma omp for schedule(static)
    for (int64_t first = 0; first < n_rows; first += PANEL_ROWS) {
        if (!ok) continue;
        const int rows = (int)(n_rows - first < PANEL_ROWS ? n_rows - first : PANEL_ROWS);
        const int blocks = (rows + 15) / 16, last_cols = rows - 16 * (blocks - 1);
        for (int b = 0; b < blocks; b++) {
            for (int r = 0; r < 16; r++) {  /* the last row stands in for missing ones */
                const int64_t at = first + (16 * b + r < rows ? 16 * b + r : rows - 1);
                decode_row_values(type, weight_row(w, row_bytes, row_map, at), k, rows16 + r * k,
                                  1);
                if (at + PANEL_ROWS < n_rows) {  /* the next tile's row, into L2 */
                    const char *next = (const char *)weight_row(w, row_bytes, row_map,
                                                                at + PANEL_ROWS);
                    for (int64_t line = 0; line < row_bytes; line += 64)
                        _mm_prefetch(next + line, _MM_HINT_T1);
                }
            }
            for (int64_t at = 0; at < k; at += 32)
                gemm_pack_tile(rows16 + at, k, panel + b * panel_elems + at / 32 * GEMM_TILE_ELEMS);
        }
        if (blocks == MICRO_TILE_BLOCKS)
            rows_through_full_panel(wide, x, x_stride, panel, pairs, m_rows, y + first, y_stride,
                                    last_cols);
        else
            for (int b = 0; b < blocks; b++)
                rows_through_block(wide, x, x_stride, panel + b * panel_elems, pairs, m_rows,
                                   y + first + 16 * b, y_stride, b == blocks - 1 ? last_cols : 16);
        if (round_to_bf16) round_tile_outputs(y + first, y_stride, m_rows, rows);
    }
    free(rows16);
    free(panel);
    free(wide.data);
    return ok;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "gguf_amx_tiles.c" /* the amx_bf16 library: the same contract on the tile unit */
#endif

/* y's n_rows columns for bf16 x, in tiles of BF16_TILE_ROWS weight rows shared out among the
 * team (every thread of the region calls it; it ends in a barrier), each tile decoded once and
 * run against all m_rows activation rows, its outputs rounded to bf16 (in float32) where
 * round_to_bf16 asks (gguf_gemm's). Returns 0 where this thread could not allocate its tile
 * (its tiles are skipped). */
static int bf16_tiles_team(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                           int64_t n_rows, int64_t k, const uint16_t *x, int64_t x_stride,
                           int64_t m_rows, float *y, int64_t y_stride, int round_to_bf16) {
    /* rows_through_tile's order (each measured 1.1-1.4x slower on the other's shapes: K = 576
     * and 640 against 2048). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx_tile_state_granted())
        return amx_tiles_team(type, w, row_bytes, row_map, n_rows, k, x, x_stride, m_rows, y,
                              y_stride, round_to_bf16);
#endif
    const int form = gguf_bf16_tiles_form(-2);
    if (m_rows >= panel_min_rows(k))
        return panel_tiles_team(type, w, row_bytes, row_map, n_rows, k, x, x_stride, m_rows, y,
                                y_stride, round_to_bf16, form == 1);
    const int whole_tile_in_l1 = BF16_TILE_ROWS * k * (int64_t)sizeof(uint16_t) <= TILE_L1_BYTES;
    uint16_t *tile = aligned_alloc(64, sizeof(uint16_t) * (size_t)(BF16_TILE_ROWS * k + 32));
    const int ok = tile != NULL, wide = gguf_bf16_tiles_form(-2) == 1;
#pragma omp for schedule(static)
    for (int64_t first = 0; first < n_rows; first += BF16_TILE_ROWS) {
        if (!ok) continue;
        int rows = (int)(n_rows - first < BF16_TILE_ROWS ? n_rows - first : BF16_TILE_ROWS);
        for (int r = 0; r < BF16_TILE_ROWS; r++) {  /* the last row stands in for missing ones */
            decode_row_values(type, weight_row(w, row_bytes, row_map,
                                               first + (r < rows ? r : rows - 1)),
                              k, tile + r * k, 1);
            if (first + BF16_TILE_ROWS + r < n_rows) {  /* the next tile's row, into L2 */
                const char *next = (const char *)weight_row(w, row_bytes, row_map,
                                                            first + BF16_TILE_ROWS + r);
                for (int64_t line = 0; line < row_bytes; line += 64)
                    _mm_prefetch(next + line, _MM_HINT_T1);
            }
        }
        rows_through_tile(whole_tile_in_l1, tile, x, x_stride, m_rows, k, rows, y + first,
                          y_stride, wide);
        if (round_to_bf16) round_tile_outputs(y + first, y_stride, m_rows, rows);
    }
    free(tile);
    return ok;
}

/* gguf_gemm's contract, for bf16 x. */
static int gemm_bf16_tiles(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                           int64_t n_rows, int64_t k, const uint16_t *x, int64_t x_stride,
                           int64_t m_rows, float *y, int64_t y_stride, int threads,
                           int round_to_bf16) {
    int status = 0;
#pragma omp parallel num_threads(threads)
    if (!bf16_tiles_team(type, w, row_bytes, row_map, n_rows, k, x, x_stride, m_rows, y,
                         y_stride, round_to_bf16)) {
#pragma omp atomic write
        status = 2;
    }
    return status;
}
