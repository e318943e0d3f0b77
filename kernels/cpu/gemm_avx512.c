/* Skinny bfloat16 GEMM with AVX-512 BF16 (VDPBF16PS) for CPUs without AMX:
 * out[M, N] = x[M, K] . W[N, K]^T (+ bias), small M (decode steps, small prefills).
 *
 * Why: through torch each projection was one oneDNN call with its own fixed cost, a hundred
 * and more per decode step, and the one-region decode step (decode_step.c) needs a GEMM it
 * can call from inside its parallel region.
 *
 * The weight is the AMX kernel's packing (gemm_common.h): per 16-column block, each input
 * pair is 64 bytes, exactly one zmm operand of VDPBF16PS, so one packed copy serves both
 * kernels. A micro-tile (gemm_micro_tiles.h) keeps R rows x C column blocks of float32 sums
 * in registers (8 x 3: 24 of the 32 zmm). A thread walks its column groups one at a time, all
 * row blocks of a group before the next (the group's panels stay in L2 after the first row
 * block), and prefetches the next group's panels into L2 during the first row block; calls of
 * many rows also prefetch each next row tile's output lines for writing. Threads
 * (torch's OpenMP runtime) split the column groups, and the rows too where groups are fewer
 * than threads.
 * Each output row's sums run over the inputs in the same order whatever M is: a row gets the
 * same bits in every batch. Accumulation is float32; outputs are rounded to bfloat16 (nearest
 * even) after the bias, as the AMX kernel does.
 *
 * The float32 form: where VDPBF16PS multiplies slower than float32 FMAs (Intel Xeons without
 * usable AMX: one VDPBF16PS per two cycles against two FMAs per cycle, timed once by
 * x86_common.h), calls of WIDE_MIN_ROWS rows or more, where the arithmetic binds rather than
 * the weight stream, widen instead: each micro-tile's x rows once into a thread's buffer
 * (exact), each packed weight vector in registers into its even and odd inputs (a shift and a
 * mask: bf16 is float32's upper half), and one FMA per input, row and column block. Its sums
 * run in another order than VDPBF16PS's, so a row's bits are the same in every batch of
 * WIDE_MIN_ROWS rows or more, and in every smaller one, not across the two. Batch-invariant
 * mode calls with fixed row tiles, so it always takes one form.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_common.h"
#include "gemm_micro_tiles.h"
#include "team_ops.h"
#include "x86_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define TILE_ROWS MICRO_TILE_ROWS /* R: rows per micro-tile */
#define GROUP MICRO_TILE_BLOCKS   /* C: 16-column blocks per micro-tile */
#ifndef WIDE_MIN_ROWS
#define WIDE_MIN_ROWS 8 /* the float32 form from here (bench/bench_gemm.py --forms) */
#endif

ALWAYS_INLINE void store_tile(MicroTileSums acc, const uint16_t *bias, GemmOut out, int64_t row,
                              int64_t col_block, int R, int C) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            gemm_store16(acc[r][c], bias ? bias + (col_block + c) * 16 : NULL, out, row + r,
                         (col_block + c) * 16);
}

/* Rows row..row+R-1 times column blocks col_block..col_block+C-1 over all `pairs` input pairs,
 * stored rounded. panel: the first block's packed panel (blocks `pairs` pairs apart);
 * next: panels to prefetch into L2 (NULL: none). */
ALWAYS_INLINE void micro_tile(const uint16_t *x, int64_t x_stride, const uint16_t *panel,
                              const uint16_t *next, int64_t pairs, const uint16_t *bias,
                              GemmOut out, int64_t row, int64_t col_block, int R, int C) {
    MicroTileSums acc;
    bf16_tile_sums(x, x_stride, panel, next, pairs, R, C, acc);
    store_tile(acc, bias, out, row, col_block, R, C);
}

/* The float32 form of micro_tile: x_wide holds the R rows widened, WIDE_STRIDE(k) apart. */
ALWAYS_INLINE void micro_tile_wide(const float *x_wide, const uint16_t *panel,
                                   const uint16_t *next, int64_t pairs, const uint16_t *bias,
                                   GemmOut out, int64_t row, int64_t col_block, int R, int C) {
    MicroTileSums acc;
    wide_tile_sums(x_wide, panel, next, pairs, R, C, acc);
    store_tile(acc, bias, out, row, col_block, R, C);
}

/* The output lines of the row tile from `row` (up to `end`) in column blocks col_block..+C-1,
 * for writing (prefetch_for_write). */
ALWAYS_INLINE void prefetch_output(GemmOut out, int64_t row, int64_t end, int64_t col_block,
                                   int C) {
    const int64_t elem = out.f32 ? 4 : 2, rows = end - row < TILE_ROWS ? end - row : TILE_ROWS;
    prefetch_for_write((const char *)out.data + (row * out.n + col_block * 16) * elem,
                       out.n * elem, rows, (int64_t)C * 16 * elem);
}

/* Rows row..row+rows-1 of column blocks col_block..col_block+C-1: whole 8-row tiles, then the
 * rest. */
ALWAYS_INLINE void column_group(const uint16_t *x, int64_t x_stride, const uint16_t *panel,
                                const uint16_t *next, int64_t pairs, const uint16_t *bias,
                                GemmOut out, int64_t row, int64_t rows, int64_t col_block, int C,
                                const WidenedRows *wide) {
    const int64_t end = row + rows;
    if (wide) { /* the float32 form (its remainder rows too) */
        for (; row < end; row += TILE_ROWS, next = NULL) {
            const int R = end - row < TILE_ROWS ? (int)(end - row) : TILE_ROWS;
            const float *x_wide = widened_rows_at(*wide, x, x_stride, row, R, 2 * pairs);
#define WIDE_TILE(R) micro_tile_wide(x_wide, panel, next, pairs, bias, out, row, col_block, R, C)
            switch (R) { /* constant R: the sums stay in registers */
            case 1: WIDE_TILE(1); break;
            case 2: WIDE_TILE(2); break;
            case 3: WIDE_TILE(3); break;
            case 4: WIDE_TILE(4); break;
            case 5: WIDE_TILE(5); break;
            case 6: WIDE_TILE(6); break;
            case 7: WIDE_TILE(7); break;
            default: WIDE_TILE(8); break;
            }
#undef WIDE_TILE
        }
        return;
    }
    for (; row + TILE_ROWS <= end; row += TILE_ROWS, next = NULL) {
        if (out.prefetch) prefetch_output(out, row + TILE_ROWS, end, col_block, C);
        micro_tile(x + row * x_stride, x_stride, panel, next, pairs, bias, out, row, col_block,
                   TILE_ROWS, C);
    }
    const uint16_t *xr = x + row * x_stride;
    switch (end - row) { /* constant R: the sums stay in registers */
    case 1: micro_tile(xr, x_stride, panel, next, pairs, bias, out, row, col_block, 1, C); break;
    case 2: micro_tile(xr, x_stride, panel, next, pairs, bias, out, row, col_block, 2, C); break;
    case 3: micro_tile(xr, x_stride, panel, next, pairs, bias, out, row, col_block, 3, C); break;
    case 4: micro_tile(xr, x_stride, panel, next, pairs, bias, out, row, col_block, 4, C); break;
    case 5: micro_tile(xr, x_stride, panel, next, pairs, bias, out, row, col_block, 5, C); break;
    case 6: micro_tile(xr, x_stride, panel, next, pairs, bias, out, row, col_block, 6, C); break;
    case 7: micro_tile(xr, x_stride, panel, next, pairs, bias, out, row, col_block, 7, C); break;
    default: break;
    }
}

static void full_group(const uint16_t *x, int64_t x_stride, const uint16_t *panel,
                       const uint16_t *next, int64_t pairs, const uint16_t *bias, GemmOut out,
                       int64_t row, int64_t rows, int64_t col_block, const WidenedRows *wide) {
    column_group(x, x_stride, panel, next, pairs, bias, out, row, rows, col_block, GROUP,
                 wide);
}

/* A narrower last group (N / 16 not a multiple of GROUP): one block at a time. */
static void single_block(const uint16_t *x, int64_t x_stride, const uint16_t *panel,
                         int64_t pairs, const uint16_t *bias, GemmOut out, int64_t row,
                         int64_t rows, int64_t col_block, const WidenedRows *wide) {
    column_group(x, x_stride, panel, NULL, pairs, bias, out, row, rows, col_block, 1, wide);
}

int avx512_bf16_available(void) { return 1; }

/* Whether CPUs of this kind take the float32 form for large calls: -1 until first asked. */
static int form_in_use = -1;

/* 0: VDPBF16PS only, 1: the float32 form from WIDE_MIN_ROWS rows (choose_form's protocol). */
int avx512_linear_form(int form) { return choose_form(&form_in_use, form); }

/* The shapes the packing takes: N % 16 == 0, K % 32 == 0; any M >= 1. */
int avx512_linear_supported(int64_t m, int64_t n, int64_t k) {
    return m >= 1 && n >= 16 && k >= 32 && n % 16 == 0 && k % 32 == 0;
}

/* Thread `me` of `threads`: its share of the work items, column groups (the last may be
 * narrower) times row parts. Rows are split only when there are fewer groups than threads
 * (many cores, narrow projections): a group's weights are then read by several threads. */
static void linear_share(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                         const uint16_t *bias, GemmOut out, int64_t m, int64_t k, int me,
                         int threads, int wide) {
    const int64_t pairs = k / 2, panel_elems = pairs * GEMM_PAIR_ELEMS, blocks = out.n / 16;
    const int64_t groups = (blocks + GROUP - 1) / GROUP;
    const int64_t row_tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    int64_t parts = (threads + groups - 1) / groups;
    parts = parts < row_tiles ? parts : row_tiles;
    const int64_t items = groups * parts;
    const int64_t first = items * me / threads, last = items * (me + 1) / threads;
    /* the float32 form's widened rows; without them (none asked for, no work here, or out of
     * memory) the VDPBF16PS form, correct all the same */
    WidenedRows rows_wide = {NULL, 0};
    if (wide && first < last) rows_wide = widened_rows_new(x, x_stride, m, k);
    const WidenedRows *x_wide = rows_wide.data ? &rows_wide : NULL;
    for (int64_t item = first; item < last; item++) {
        const int64_t g = item / parts, part = item % parts;
        const int64_t row = row_tiles * part / parts * TILE_ROWS;
        const int64_t end = row_tiles * (part + 1) / parts * TILE_ROWS;
        const int64_t rows = (end < m ? end : m) - row;
        const int64_t block = g * GROUP, width = blocks - block < GROUP ? blocks - block : GROUP;
        const uint16_t *panel = packed + block * panel_elems;
        const uint16_t *next = parts == 1 && item + 1 < last && blocks - block - GROUP >= GROUP
                                   ? panel + GROUP * panel_elems
                                   : NULL;
        if (width == GROUP)
            full_group(x, x_stride, panel, next, pairs, bias, out, row, rows, block, x_wide);
        else
            for (int64_t b = 0; b < width; b++)
                single_block(x, x_stride, panel + b * panel_elems, pairs, bias, out, row, rows,
                             block + b, x_wide);
    }
    free(rows_wide.data);
}

int avx512_linear_wide_min_rows(void) { return WIDE_MIN_ROWS; }

/* The form a call of m rows takes (the same in the team and alone, so that the fused decode
 * step keeps the layer path's bits). */
static int takes_wide_form(int64_t m) {
    return m >= WIDE_MIN_ROWS && avx512_linear_form(-2) == 1;
}

/* avx512_linear_bf16 (bf16 output) for every thread of an enclosing OpenMP team
 * (decode_step.c), ending in a barrier. The caller checked avx512_linear_supported. */
void avx512_linear_team(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                        const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k) {
    const GemmOut rows = {out, n, 0, 0};
    linear_share(x, x_stride, packed, bias, rows, m, k, omp_get_thread_num(),
                 omp_get_num_threads(), takes_wide_form(m));
#pragma omp barrier
}

/* x: [m, k] bf16 rows x_stride elements apart; packed: amx_pack_weight of W [n, k]; bias: [n]
 * bf16 or NULL; out: contiguous [m, n], bf16, or with out_f32 float32 (the bf16-rounded values
 * widened). Returns 1 (nothing written) when unsupported. */
int avx512_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                       const uint16_t *bias, void *out, int64_t m, int64_t n, int64_t k,
                       int out_f32, int num_threads) {
    if (!avx512_linear_supported(m, n, k)) return 1;
    const int stream = gemm_streams(out, m, n, out_f32);
    const GemmOut rows = {out, n, out_f32, stream, m >= PREFETCH_OUT_MIN_ROWS && !stream};
    const int wide = takes_wide_form(m);
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
        linear_share(x, x_stride, packed, bias, rows, m, k, omp_get_thread_num(),
                     omp_get_num_threads(), wide);
        if (rows.stream) _mm_sfence(); /* streamed lines visible before the region ends */
    }
    return 0;
}

#else /* no AVX-512 BF16 at build time: callers keep oneDNN or F.linear */

int avx512_bf16_available(void) { return 0; }
int avx512_linear_form(int form) { return 0; }
int avx512_linear_wide_min_rows(void) { return 0; }
int avx512_linear_supported(int64_t m, int64_t n, int64_t k) { return 0; }
void avx512_linear_team(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                        const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k) {}
int avx512_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                       const uint16_t *bias, void *out, int64_t m, int64_t n, int64_t k,
                       int out_f32, int num_threads) {
    return 1;
}

#endif
