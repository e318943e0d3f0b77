/* Skinny bfloat16 GEMM on AMX for decode steps: out[M, N] = x[M, K] . W[N, K]^T, small M.
 *
 * Why: a decode step multiplies a few dozen token rows by every weight of the model, so its
 * GEMMs are bound by streaming the weights from memory. Through torch, oneDNN's AMX kernel
 * streamed the weights slowly and had a large fixed cost per call, paid over a hundred times a
 * step; this kernel streams each weight panel once per call, prefetching the next panel while
 * the tile unit works on the current one, and costs little to call (bench/FIGURES.md).
 *
 * Weights are repacked once at start-up (amx_pack_weight, gemm_common.h) into the tile
 * unit's VNNI layout: for each block of 16 output columns and 32 inputs, a 1 KB tile whose row k2 holds, for each
 * of the 16 columns, the pair W[n][2 k2], W[n][2 k2 + 1]. Accumulation is float32 in the tiles;
 * outputs are rounded to bfloat16 (nearest even), as oneDNN does; only the summation order
 * differs. Threads (torch's OpenMP runtime) split the output columns.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_common.h"

/* Always compiled: the AVX-512 BF16 and AVX2 kernels (gemm_avx512.c, gemm_avx2.c) read the
 * same layout. */
int amx_pack_weight(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    if (n % 16 != 0 || k % 32 != 0) return 1;
    const int64_t kblocks = k / 32;
    for (int64_t nb = 0; nb < n / 16; nb++)
        for (int64_t kb = 0; kb < kblocks; kb++) {
            uint16_t *tile = out + (nb * kblocks + kb) * GEMM_TILE_ELEMS;
#if defined(__AVX512F__)
            gemm_pack_tile(w + nb * 16 * k + kb * 32, k, tile);
#else
            for (int k2 = 0; k2 < 16; k2++)
                for (int col = 0; col < 16; col++) {
                    const uint16_t *src = w + (nb * 16 + col) * k + kb * 32 + 2 * k2;
                    tile[k2 * 32 + 2 * col] = src[0];
                    tile[k2 * 32 + 2 * col + 1] = src[1];
                }
#endif
        }
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>

#include "amx_column_pair.h"
#include "x86_common.h"
#include <omp.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_ROW_BLOCKS 4              /* 4 x 16 rows: M <= 64 */

int amx_available(void) { return amx_tile_state_granted(); }

/* Tile use (configure_full_tiles): 0-3 accumulators of row blocks 0-3; 4 and 6: x row blocks;
 * 5 and 7: weight tiles. */

/* acc[rb] += x rows of block rb, inputs of k block KB, times weight tile WT (x tiles 4 and 6
 * alternate so that a load need not wait for the product before it). */
#define ROW_PRODUCTS(KB, WT)                                                        \
    do {                                                                           \
        _tile_loadd(4, x + (KB) * 32, x_stride_bytes);                             \
        _tile_dpbf16ps(0, 4, WT);                                                  \
        if (ROW_BLOCKS > 1) {                                                      \
            _tile_loadd(6, x + block_rows + (KB) * 32, x_stride_bytes);            \
            _tile_dpbf16ps(1, 6, WT);                                              \
        }                                                                          \
        if (ROW_BLOCKS > 2) {                                                      \
            _tile_loadd(4, x + 2 * block_rows + (KB) * 32, x_stride_bytes);        \
            _tile_dpbf16ps(2, 4, WT);                                              \
        }                                                                          \
        if (ROW_BLOCKS > 3) {                                                      \
            _tile_loadd(6, x + 3 * block_rows + (KB) * 32, x_stride_bytes);        \
            _tile_dpbf16ps(3, 6, WT);                                              \
        }                                                                          \
    } while (0)

/* One block of 16 output columns for all (padded) rows: float32 sums into acc[rb][16][16]. */
ALWAYS_INLINE void column_block(const uint16_t *x, int64_t x_stride_bytes, int64_t kblocks,
                                const uint16_t *panel, const uint16_t *next_panel,
                                float (*acc)[16][16], int ROW_BLOCKS) {
    const int64_t block_rows = 16 * x_stride_bytes / 2; /* elements to the next row block */
    _tile_zero(0);
    if (ROW_BLOCKS > 1) _tile_zero(1);
    if (ROW_BLOCKS > 2) _tile_zero(2);
    if (ROW_BLOCKS > 3) _tile_zero(3);
    /* Two weight tiles (5 and 7) in turn: the next one loads while the products of the
     * current one run. kblocks is even for every K that is a multiple of 64. */
    int64_t kb = 0;
    for (; kb + 1 < kblocks; kb += 2) {
        _tile_loadd(5, panel + kb * TILE_ELEMS, 64);
        _tile_loadd(7, panel + (kb + 1) * TILE_ELEMS, 64);
        if (next_panel) {
            prefetch_tile(next_panel + kb * TILE_ELEMS);
            prefetch_tile(next_panel + (kb + 1) * TILE_ELEMS);
        }
        ROW_PRODUCTS(kb, 5);
        ROW_PRODUCTS(kb + 1, 7);
    }
    if (kb < kblocks) {
        _tile_loadd(5, panel + kb * TILE_ELEMS, 64);
        if (next_panel) prefetch_tile(next_panel + kb * TILE_ELEMS);
        ROW_PRODUCTS(kb, 5);
    }
    _tile_stored(0, acc[0], 64);
    if (ROW_BLOCKS > 1) _tile_stored(1, acc[1], 64);
    if (ROW_BLOCKS > 2) _tile_stored(2, acc[2], 64);
    if (ROW_BLOCKS > 3) _tile_stored(3, acc[3], 64);
}

static void store_rows(float (*acc)[16][16], int64_t rows, const uint16_t *bias, GemmOut out,
                       int64_t col) {
    for (int64_t r = 0; r < rows; r++)
        gemm_store16(_mm512_loadu_ps(acc[r / 16][r % 16]), bias, out, r, col);
}

/* Rows [0, rows) of a column pair's sums (acc[2 * row block + column block]) into out from
 * row `row`, column `col`. */
static void store_pair_rows(float (*acc)[16][16], int64_t rows, const uint16_t *bias,
                            GemmOut out,
                            int64_t row, int64_t col) {
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < 2; c++)
            gemm_store16(_mm512_loadu_ps(acc[2 * (r / 16) + c][r % 16]),
                         bias ? bias + 16 * c : NULL, out, row + r, col + 16 * c);
}

/* Long K is taken in runs of this many k blocks (2,048 inputs), every column pair of the
 * thread's share through one run before the next: with all of K at once, a row-block pair's x
 * (16 KB a row at K = 8,192) and the pair's panels (512 KB) no longer stayed in L2 between
 * their uses, and the GEMM ran well below both the memory and the tile unit's rate. */
#define K_RUN_BLOCKS 64

/* A thread's scratch, kept from call to call: a fresh allocation of a few hundred KB each call
 * is an mmap and its page faults. */
typedef struct {
    void *data;
    size_t bytes;
} ThreadScratch;

/* At least `bytes` of s, 64-byte aligned (its old contents dropped when it grows); NULL where it
 * cannot grow. */
static void *scratch_of(ThreadScratch *s, size_t bytes) {
    if (bytes > s->bytes) {
        free(s->data);
        s->data = aligned_alloc(64, (bytes + 63) / 64 * 64);
        s->bytes = s->data != NULL ? bytes : 0;
    }
    return s->data;
}

/* Each thread's sums between runs: one 16 x 16 float32 tile per row block and column block of
 * its share. */
static __thread ThreadScratch sums_scratch;

/* From 8 to 16 row blocks (113-256 rows) each thread copies a run's activations into rows one
 * cache line longer than the run. An x tile's 16 rows at the model's stride (4 or 16 KB for
 * K = 2,048 or 8,192) all fall in one L1 set, more lines than its ways, and every column pair
 * reloads them; the copy costs a pass over x per thread and run. Fewer rows are read few times
 * and gained nothing; more outgrow L2 (a run's copy is 4 KB a row) and lost. */
#define COPY_MIN_ROW_BLOCKS 8
#define COPY_MAX_ROW_BLOCKS 16
#define COPY_PAD 32 /* elements: one cache line */

static __thread ThreadScratch copy_scratch;

/* x's row blocks, inputs [32 k0, 32 (k0 + blocks)), at `copy` with rows copy_stride apart. */
static void copy_run(const uint16_t *x, int64_t stride_bytes, int row_blocks, int64_t k0,
                     int64_t blocks, uint16_t *copy, int64_t copy_stride) {
    for (int64_t r = 0; r < 16 * row_blocks; r++)
        memcpy(copy + r * copy_stride, x + r * (stride_bytes / 2) + 32 * k0,
               (size_t)(64 * blocks));
}

/* M > 16: column pairs, row blocks two at a time (the pair's panels stay in L2 between).
 * The run's sums are stored and loaded back exactly, so the bits do not depend on the runs. */
static void linear_pairs(const uint16_t *x, int64_t stride_bytes, const uint16_t *packed,
                         const uint16_t *bias, GemmOut out, int64_t m, int64_t kblocks,
                         int row_blocks, int64_t first_pair, int64_t last_pair) {
    const int64_t pair_elems = 2 * kblocks * TILE_ELEMS;
    const int64_t panel = kblocks * TILE_ELEMS, row_pairs = (row_blocks + 1) / 2;
    float one_run[4][16][16] __attribute__((aligned(64)));
    float (*sums)[16][16] = one_run;
    int64_t run = kblocks; /* all of K at once where it is short, or without the buffer */
    if (kblocks > K_RUN_BLOCKS) {
        float (*kept)[16][16] =
            scratch_of(&sums_scratch, (size_t)((last_pair - first_pair) * row_pairs) * 4096);
        if (kept != NULL) sums = kept, run = K_RUN_BLOCKS;
    }
    const int64_t copy_stride = 32 * run + COPY_PAD;
    uint16_t *copy = row_blocks >= COPY_MIN_ROW_BLOCKS && row_blocks <= COPY_MAX_ROW_BLOCKS
                     && last_pair > first_pair
        ? scratch_of(&copy_scratch, (size_t)(16 * row_blocks * copy_stride) * 2) : NULL;
    for (int64_t k0 = 0; k0 < kblocks; k0 += run) {
        const int64_t run_blocks = kblocks - k0 < run ? kblocks - k0 : run;
        const int last_run = k0 + run_blocks == kblocks;
        const uint16_t *xs = x + 32 * k0; /* the run's x, rows xs_bytes apart */
        int64_t xs_bytes = stride_bytes;
        if (copy != NULL) {
            copy_run(x, stride_bytes, row_blocks, k0, run_blocks, copy, copy_stride);
            xs = copy, xs_bytes = 2 * copy_stride;
        }
        for (int64_t cp = first_pair; cp < last_pair; cp++) {
            const uint16_t *panels = packed + cp * pair_elems + k0 * TILE_ELEMS;
            /* prefetched: the next pair's run, else the first pair's next run */
            const uint16_t *next = cp + 1 < last_pair ? panels + pair_elems
                : !last_run ? packed + first_pair * pair_elems + (k0 + run) * TILE_ELEMS : NULL;
            for (int rb = 0; rb < row_blocks; rb += 2) {
                const uint16_t *xr = xs + rb * 8 * xs_bytes;
                float (*acc)[16][16] =
                    run == kblocks ? sums : sums + 4 * ((cp - first_pair) * row_pairs + rb / 2);
                const uint16_t *ahead = rb == 0 ? next : NULL;
                if (rb + 1 < row_blocks)
                    column_pair(xr, xs_bytes, run_blocks, panel, panels, ahead, acc, k0 > 0, 2);
                else
                    column_pair(xr, xs_bytes, run_blocks, panel, panels, ahead, acc, k0 > 0, 1);
                if (!last_run) continue;
                int64_t rows = m - 16 * rb < 32 ? m - 16 * rb : 32;
                store_pair_rows(acc, rows, bias ? bias + cp * 32 : NULL, out, 16 * rb, cp * 32);
            }
        }
    }
}

/* Whether amx_linear_bf16 takes this shape (and the CPU has AMX): N % 16 == 0, K % 32 == 0,
 * and M <= 64 when N / 16 is odd (single column blocks hold at most 4 row blocks). */
int amx_linear_supported(int64_t m, int64_t n, int64_t k) {
    if (m < 1 || n % 16 != 0 || k % 32 != 0 || !amx_tile_state_granted()) return 0;
    return (n / 16) % 2 == 0 || m <= 16 * MAX_ROW_BLOCKS;
}

/* This thread's share (thread `me` of `threads`) of the output columns. x has whole 16-row
 * blocks readable (rows past m are read and their sums dropped). */
static void linear_share(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                         const uint16_t *bias, GemmOut out, int64_t m, int64_t k, int me,
                         int threads) {
    const int64_t n = out.n;
    const int64_t kblocks = k / 32, column_blocks = n / 16, stride_bytes = x_stride * 2;
    const int row_blocks = (int)((m + 15) / 16);
    float acc[MAX_ROW_BLOCKS][16][16];
    configure_full_tiles();
    if (column_blocks % 2 == 0) {
        int64_t pairs = column_blocks / 2;
        linear_pairs(x, stride_bytes, packed, bias, out, m, kblocks, row_blocks,
                     pairs * me / threads, pairs * (me + 1) / threads);
    } else {
        int64_t first = column_blocks * me / threads, last = column_blocks * (me + 1) / threads;
        for (int64_t cb = first; cb < last; cb++) {
            const uint16_t *panel = packed + cb * kblocks * TILE_ELEMS;
            const uint16_t *next = cb + 1 < last ? panel + kblocks * TILE_ELEMS : NULL;
            switch (row_blocks) {
            case 1: column_block(x, stride_bytes, kblocks, panel, next, acc, 1); break;
            case 2: column_block(x, stride_bytes, kblocks, panel, next, acc, 2); break;
            case 3: column_block(x, stride_bytes, kblocks, panel, next, acc, 3); break;
            default: column_block(x, stride_bytes, kblocks, panel, next, acc, 4); break;
            }
            store_rows(acc, m, bias ? bias + cb * 16 : NULL, out, cb * 16);
        }
    }
    _tile_release();
}

/* amx_linear_bf16 for every thread of an enclosing OpenMP team (decode_step.c), ending
 * in a barrier. The caller checked amx_linear_supported and gives x whole 16-row blocks. */
void amx_linear_team(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                     const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k) {
    const GemmOut rows = {out, n, 0, 0};
    linear_share(x, x_stride, packed, bias, rows, m, k, omp_get_thread_num(),
                 omp_get_num_threads());
#pragma omp barrier
}

/* x: [m, k] bf16 rows x_stride elements apart; packed: amx_pack_weight of W [n, k]; bias: [n]
 * bf16 or NULL; out: contiguous [m, n], bf16, or with out_f32 float32 (the bf16-rounded values
 * widened). Returns 1 (nothing written) when unsupported. */
int amx_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                    const uint16_t *bias, void *out, int64_t m, int64_t n, int64_t k,
                    int out_f32, int num_threads) {
    if (!amx_linear_supported(m, n, k)) return 1;
    /* Tile loads read whole 16-row blocks: copy x into a zero-padded buffer when m is not a
     * multiple of 16 (a few KB: the rows of one decode step). */
    uint16_t *padded = NULL;
    if (m % 16 != 0) {
        padded = calloc((size_t)((m + 15) / 16) * 16 * (size_t)k, sizeof(uint16_t));
        if (!padded) return 1;
        for (int64_t r = 0; r < m; r++) memcpy(padded + r * k, x + r * x_stride, (size_t)k * 2);
        x = padded, x_stride = k;
    }
    const GemmOut rows = {out, n, out_f32, 0}; /* streaming untried on AMX (no AMX CPU here) */
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    linear_share(x, x_stride, packed, bias, rows, m, k, omp_get_thread_num(),
                 omp_get_num_threads());
    free(padded);
    return 0;
}

#else /* no AMX at build time: callers keep oneDNN */

int amx_available(void) { return 0; }
int amx_linear_supported(int64_t m, int64_t n, int64_t k) { return 0; }
void amx_linear_team(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                     const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k) {}
int amx_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                    const uint16_t *bias, void *out, int64_t m, int64_t n, int64_t k,
                    int out_f32, int num_threads) {
    return 1;
}

#endif
