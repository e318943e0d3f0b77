/* The micro-tiles of the AVX-512 BF16 GEMM over the packed weight layout (gemm_common.h),
 * shared by the dense GEMM (gemm_avx512.c) and the GGUF bf16 tiles (gguf/gguf_bf16_tiles.c),
 * which decode a few packed-layout panels per call and run them through the same sums: one
 * kernel to tune, and a GGUF weight's product gets the dense GEMM's bits on its dequantized
 * weight.
 *
 * A micro-tile keeps R rows x C column blocks of float32 sums in registers (at most
 * MICRO_TILE_ROWS x MICRO_TILE_BLOCKS: 24 of the 32 zmm); per input pair it loads C weight
 * vectors, broadcasts R pairs of x, and issues R * C VDPBF16PS, or in the float32 form splits
 * each weight vector into its even and odd inputs (a shift and a mask: bf16 is float32's upper
 * half) and issues two FMAs per row and block on x rows widened once per micro-tile. Both run
 * over the inputs in order, so a row's sums do not depend on the other rows of its call.
 */
#ifndef PAGEDGEN_CPU_GEMM_MICRO_TILES_H
#define PAGEDGEN_CPU_GEMM_MICRO_TILES_H

#include <stdint.h>
#include <string.h>

#include "gemm_common.h"
#include "x86_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#ifndef MICRO_TILE_ROWS /* -D overrides: for trying other tile shapes */
#define MICRO_TILE_ROWS 8
#endif
#ifndef MICRO_TILE_BLOCKS
#define MICRO_TILE_BLOCKS 3
#endif

/* Row stride of the float32 form's widened rows: k plus one cache line, so that a tile's rows
 * do not all fall into one L1 set when k is a multiple of 1024. */
#define WIDE_STRIDE(k) ((k) + 16)

typedef __m512 MicroTileSums[MICRO_TILE_ROWS][MICRO_TILE_BLOCKS];

/* Calls of this many rows write-prefetch their output (prefill chunks; a decode step's output
 * is small and still in cache from the step's previous projection). */
#define PREFETCH_OUT_MIN_ROWS 256

/* `rows` output rows of `bytes` each from `first`, `stride` bytes apart, prefetched for
 * writing. A large output is not in cache, and a micro-tile's stores each wait for their line
 * to be read for ownership: a tile's stores at once filled the store queue and stalled the next
 * tile's arithmetic. Issued for the next tile at the start of each, the reads overlap it. */
static inline __attribute__((always_inline)) void prefetch_for_write(const void *first,
                                                                     int64_t stride, int64_t rows,
                                                                     int64_t bytes) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < bytes + 63; b += 64)
            __builtin_prefetch((const char *)first + r * stride + b, 1, 3);
}

static inline __attribute__((always_inline)) __m512bh x_pair(const uint16_t *x) {
    int32_t pair; /* x[0], x[1] in every 32-bit lane */
    memcpy(&pair, x, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* acc[r][c] = rows r < R of x (bf16, x_stride apart) times column blocks c < C over all
 * `pairs` input pairs. panel: the first block's panel (blocks pairs * GEMM_PAIR_ELEMS apart);
 * next: panels to prefetch into L2 meanwhile (NULL: none). */
static inline __attribute__((always_inline)) void bf16_tile_sums(
        const uint16_t *x, int64_t x_stride, const uint16_t *panel, const uint16_t *next,
        int64_t pairs, int R, int C, MicroTileSums acc) {
    const int64_t panel_elems = pairs * GEMM_PAIR_ELEMS;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh w[MICRO_TILE_BLOCKS];
        for (int c = 0; c < C; c++)
            w[c] = (__m512bh)_mm512_loadu_si512(panel + c * panel_elems + p * GEMM_PAIR_ELEMS);
        if (next)
            for (int c = 0; c < C; c++)
                _mm_prefetch((const char *)(next + c * panel_elems + p * GEMM_PAIR_ELEMS),
                             _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            const __m512bh xr = x_pair(x + r * x_stride + 2 * p);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xr, w[c]);
        }
    }
}

/* The float32 form of bf16_tile_sums: x_wide holds the R rows widened, WIDE_STRIDE(2 pairs)
 * apart (widen_rows). */
static inline __attribute__((always_inline)) void wide_tile_sums(
        const float *x_wide, const uint16_t *panel, const uint16_t *next, int64_t pairs, int R,
        int C, MicroTileSums acc) {
    const int64_t panel_elems = pairs * GEMM_PAIR_ELEMS, stride = WIDE_STRIDE(2 * pairs);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512 even_w[MICRO_TILE_BLOCKS], odd_w[MICRO_TILE_BLOCKS];
        for (int c = 0; c < C; c++) {
            const __m512i w =
                _mm512_loadu_si512(panel + c * panel_elems + p * GEMM_PAIR_ELEMS);
            even_w[c] = bf16_pairs_even(w);
            odd_w[c] = bf16_pairs_odd(w);
        }
        if (next)
            for (int c = 0; c < C; c++)
                _mm_prefetch((const char *)(next + c * panel_elems + p * GEMM_PAIR_ELEMS),
                             _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            const __m512 x0 = _mm512_set1_ps(x_wide[r * stride + 2 * p]);
            const __m512 x1 = _mm512_set1_ps(x_wide[r * stride + 2 * p + 1]);
            for (int c = 0; c < C; c++)
                acc[r][c] =
                    _mm512_fmadd_ps(x1, odd_w[c], _mm512_fmadd_ps(x0, even_w[c], acc[r][c]));
        }
    }
}

/* Rows of x (bf16, x_stride apart) -> float32 rows of k values, WIDE_STRIDE(k) apart, exact. */
static inline void widen_rows(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k,
                              float *wide) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i += 16)
            _mm512_storeu_ps(wide + r * WIDE_STRIDE(k) + i, bf16x16_to_f32(x + r * x_stride + i));
}

/* A call's activations widened for the float32 form, per thread: all m rows once where they
 * take at most WIDE_ALL_ROWS_BYTES (decode steps, prefill chunks of a few hundred rows:
 * widening a micro-tile's rows again for every column group cost 6-14% of the GEMM), else one
 * micro-tile's rows at a time. data NULL: out of memory (the caller takes the VDPBF16PS
 * form, correct all the same). */
#define WIDE_ALL_ROWS_BYTES (4 << 20)

typedef struct {
    float *data;
    int all_rows;
} WidenedRows;

static inline WidenedRows widened_rows_new(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    const int all_rows = m * WIDE_STRIDE(k) * (int64_t)sizeof(float) <= WIDE_ALL_ROWS_BYTES;
    const int64_t rows = all_rows ? m : MICRO_TILE_ROWS;
    WidenedRows wide = {aligned_alloc(64, (size_t)(rows * WIDE_STRIDE(k)) * sizeof(float)),
                     all_rows};
    if (wide.data && all_rows) widen_rows(x, x_stride, m, k, wide.data);
    return wide;
}

/* Rows row..row+R-1 of x widened: in place where all rows are, else widened now. */
static inline const float *widened_rows_at(WidenedRows wide, const uint16_t *x, int64_t x_stride,
                                        int64_t row, int R, int64_t k) {
    if (wide.all_rows) return wide.data + row * WIDE_STRIDE(k);
    widen_rows(x + row * x_stride, x_stride, R, k, wide.data);
    return wide.data;
}
#endif

#endif
