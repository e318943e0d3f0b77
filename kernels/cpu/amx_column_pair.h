/* The AMX product of a pair of packed 16-column weight blocks with one or two 16-row blocks of
 * bf16 rows: the inner step of the skinny AMX GEMM (gemm_amx.c). The GGUF library's AMX tiles
 * (gguf/gguf_amx_tiles.c) take the same products in the same order along K in a loop of their
 * own, which decodes the next weight panel between steps. The caller configured the tiles
 * (configure_full_tiles) and has the process's AMX permission.
 */
#ifndef PAGEDGEN_CPU_AMX_COLUMN_PAIR_H
#define PAGEDGEN_CPU_AMX_COLUMN_PAIR_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>

#include "gemm_common.h"

#define TILE_ELEMS GEMM_TILE_ELEMS /* 16 rows x 32 bf16: one packed weight tile */

/* Into L2 (T1), not L1: a panel ahead is up to ~36 KB, most of L1, and fetching it into L1
 * evicted the current panel (T1 was faster at M = 16-64: bench/FIGURES.md). */
static inline __attribute__((always_inline)) void prefetch_tile(const uint16_t *tile) {
    for (int line = 0; line < 16; line++)
        _mm_prefetch((const char *)(tile + line * 32), _MM_HINT_T1);
}

/* Two blocks of 16 output columns for one or two row blocks: each x tile feeds two products
 * and each weight tile two (tiles: 0-3 sums [row][column], 4-5 x, 6-7 weights), half the x
 * tile loads of gemm_amx.c's column_block per product: what bounds the time once M > 16.
 * `kblocks` k blocks from `panels` (the first column block's) and panels + `panel` (the
 * second's); with `resume` the sums go on from acc (a previous run of K), else from zero. */
static inline __attribute__((always_inline)) void column_pair(
        const uint16_t *x, int64_t x_stride_bytes, int64_t kblocks, int64_t panel,
        const uint16_t *panels, const uint16_t *next_panels, float (*acc)[16][16], int resume,
        int ROW_BLOCKS) {
    const int64_t block_rows = 16 * x_stride_bytes / 2;
    if (resume) {
        _tile_loadd(0, acc[0], 64);
        _tile_loadd(1, acc[1], 64);
        if (ROW_BLOCKS > 1) {
            _tile_loadd(2, acc[2], 64);
            _tile_loadd(3, acc[3], 64);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        if (ROW_BLOCKS > 1) {
            _tile_zero(2);
            _tile_zero(3);
        }
    }
    for (int64_t kb = 0; kb < kblocks; kb++) {
        _tile_loadd(6, panels + kb * TILE_ELEMS, 64);
        _tile_loadd(7, panels + panel + kb * TILE_ELEMS, 64);
        if (next_panels) {
            prefetch_tile(next_panels + kb * TILE_ELEMS);
            prefetch_tile(next_panels + panel + kb * TILE_ELEMS);
        }
        _tile_loadd(4, x + kb * 32, x_stride_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (ROW_BLOCKS > 1) {
            _tile_loadd(5, x + block_rows + kb * 32, x_stride_bytes);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc[0], 64); /* acc[2 * row + column] */
    _tile_stored(1, acc[1], 64);
    if (ROW_BLOCKS > 1) {
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
    }
}

#endif
#endif
