/* Skinny bfloat16 GEMM for x86 CPUs with AVX2 and FMA but no AVX-512 BF16 (AMD Zen 1-3,
 * Intel Haswell to Alder Lake): out[M, N] = x[M, K] . W[N, K]^T (+ bias).
 *
 * Why: such CPUs have no bf16 arithmetic, and torch's bf16 GEMM there widens both operands in
 * memory and runs several times slower than its float32 one, so a bf16 model ran in float32:
 * twice the weight bytes per step. Decode steps stream every weight once per step and are
 * bound by those bytes. Here the weights stay bf16 in memory and are widened in registers (a
 * bf16 value is the upper half of its float32: a shift or a mask), the products and sums are
 * float32 FMAs, so each step reads half the bytes of the float32 run for the same arithmetic.
 *
 * The weight is the shared packing (gemm_common.h): per 16-column block, each input pair is 64
 * bytes, two ymm loads (columns 0-7 and 8-15), each widened into the pair's even and odd
 * inputs. The x rows are widened once per call into a float32 buffer (SLAB_ROWS rows at a
 * time, bounding it for large prefills), from which each row's two inputs are broadcast. A
 * micro-tile keeps TILE_ROWS rows x 16 columns of float32 sums in 8 of the 16 ymm registers;
 * a thread runs all its row tiles over one column block before the next, so the block's panel
 * comes from DRAM once and from L2 after the first tile. Every tile prefetches the weight
 * stream AHEAD_BYTES ahead of what it reads (the next panel, at the K of most projections):
 * the hardware prefetchers alone kept too few lines in flight to stream the weight at 1-4 rows,
 * and at 8-64 rows the first tile of each block waited for DRAM while the others ran from L2.
 * Threads (torch's OpenMP runtime) split the column blocks, and the rows too where blocks are
 * fewer than threads.
 *
 * Every row's sums run over the inputs in the same order (pair by pair, even input then odd)
 * whatever M and the tiling: a row gets the same bits in every batch. Outputs are the float32
 * sums plus the bias, rounded once to bf16 (nearest even, as torch rounds), or those rounded
 * values widened to float32 (the LM head's logits).
 */
#include <stdint.h>
#include <stdlib.h>

#include "gemm_common.h"
#include "x86_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define TILE_ROWS 4    /* 4 rows x 2 halves: 8 sums, 4 widened weights, a broadcast, in 16 ymm */
#define SLAB_ROWS 256  /* rows widened at a time: 256 x K floats, 2 MiB at K = 2,048 */
/* Prefetch distance: one panel at K = 2,048 (64 KB); at larger K (a down projection's 8,192: 256
 * KB panels) a panel ahead was too far, the prefetched lines evicted from L2 before their use. */
#define AHEAD_BYTES (64 << 10)

typedef __m256 TileSums[TILE_ROWS][2];

/* R rows of widened x (row r at x_wide + r * k) times one 16-column block's panel; with
 * `ahead`, the weight stream from there on is prefetched into L2, one line per pair. */
ALWAYS_INLINE void tile_sums(const float *x_wide, int64_t k, const uint16_t *panel,
                             int64_t pairs, int R, TileSums acc, const uint16_t *ahead) {
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        if (ahead) _mm_prefetch((const char *)(ahead + p * GEMM_PAIR_ELEMS), _MM_HINT_T1);
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(panel + p * GEMM_PAIR_ELEMS));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(panel + p * GEMM_PAIR_ELEMS + 16));
        const __m256 even_lo = bf16_pairs_even8(lo), odd_lo = bf16_pairs_odd8(lo);
        const __m256 even_hi = bf16_pairs_even8(hi), odd_hi = bf16_pairs_odd8(hi);
        for (int r = 0; r < R; r++) {
            const float *xr = x_wide + r * k + 2 * p;
            const __m256 x_even = _mm256_broadcast_ss(xr);
            acc[r][0] = _mm256_fmadd_ps(even_lo, x_even, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(even_hi, x_even, acc[r][1]);
            const __m256 x_odd = _mm256_broadcast_ss(xr + 1);
            acc[r][0] = _mm256_fmadd_ps(odd_lo, x_odd, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(odd_hi, x_odd, acc[r][1]);
        }
    }
}

/* One row's 16 sums (+ bias) of column block `block`, rounded, into out. */
ALWAYS_INLINE void store_row(__m256 lo, __m256 hi, const uint16_t *bias, GemmOut out,
                             int64_t row, int64_t col) {
    if (bias) {
        lo = _mm256_add_ps(lo, bf16x8_to_f32(bias + col));
        hi = _mm256_add_ps(hi, bf16x8_to_f32(bias + col + 8));
    }
    const __m256i rlo = bf16x8_round(lo), rhi = bf16x8_round(hi);
    if (out.f32) {
        float *dst = (float *)out.data + row * out.n + col;
        if (out.stream) { /* n % 16 == 0, 64-byte aligned data: every row start is aligned */
            _mm256_stream_ps(dst, _mm256_castsi256_ps(rlo));
            _mm256_stream_ps(dst + 8, _mm256_castsi256_ps(rhi));
        } else {
            _mm256_storeu_ps(dst, _mm256_castsi256_ps(rlo));
            _mm256_storeu_ps(dst + 8, _mm256_castsi256_ps(rhi));
        }
        return;
    }
    bf16x16_store_rounded((uint16_t *)out.data + row * out.n + col, rlo, rhi);
}

ALWAYS_INLINE void micro_tile(const float *x_wide, int64_t k, const uint16_t *panel,
                              const uint16_t *limit, const uint16_t *bias, GemmOut out,
                              int64_t row, int64_t col, int R) {
    const int64_t panel_elems = k / 2 * GEMM_PAIR_ELEMS, ahead_elems = AHEAD_BYTES / 2;
    const uint16_t *ahead = panel + (panel_elems < ahead_elems ? panel_elems : ahead_elems);
    TileSums acc;
    /* two copies: the test is made once per tile, not per pair (at 64 rows and more, a compare
     * per pair cost more than the prefetches gave). Past this thread's weight: none. */
    if (ahead + panel_elems <= limit) tile_sums(x_wide, k, panel, k / 2, R, acc, ahead);
    else tile_sums(x_wide, k, panel, k / 2, R, acc, NULL);
    for (int r = 0; r < R; r++) store_row(acc[r][0], acc[r][1], bias, out, row + r, col);
}

/* Rows row..end-1 (of the slab starting at slab_row, widened in x_wide) of one column block;
 * limit: the end of the weight this thread reads. */
static void block_rows(const float *x_wide, int64_t k, const uint16_t *panel,
                       const uint16_t *limit, const uint16_t *bias, GemmOut out,
                       int64_t slab_row, int64_t row, int64_t end, int64_t col) {
    for (; row < end; row += TILE_ROWS) {
        const float *xr = x_wide + (row - slab_row) * k;
        switch (end - row) { /* constant R: the sums stay in registers */
        case 1: micro_tile(xr, k, panel, limit, bias, out, row, col, 1); break;
        case 2: micro_tile(xr, k, panel, limit, bias, out, row, col, 2); break;
        case 3: micro_tile(xr, k, panel, limit, bias, out, row, col, 3); break;
        default: micro_tile(xr, k, panel, limit, bias, out, row, col, TILE_ROWS); break;
        }
    }
}

/* Thread `me` of `threads`: its share of a slab's work items, column blocks times row parts.
 * Rows are split only where there are fewer blocks than threads (narrow projections). */
static void slab_share(const float *x_wide, const uint16_t *packed, const uint16_t *bias,
                       GemmOut out, int64_t slab_row, int64_t slab_rows, int64_t k, int me,
                       int threads) {
    const int64_t blocks = out.n / 16, tiles = (slab_rows + TILE_ROWS - 1) / TILE_ROWS;
    int64_t parts = (threads + blocks - 1) / blocks;
    parts = parts < tiles ? parts : tiles;
    const int64_t items = blocks * parts;
    const int64_t first = items * me / threads, last = items * (me + 1) / threads;
    const int64_t panel_elems = (k / 2) * GEMM_PAIR_ELEMS;
    const uint16_t *limit = packed + ((last - 1) / parts + 1) * panel_elems; /* for the prefetch */
    for (int64_t item = first; item < last; item++) {
        const int64_t block = item / parts, part = item % parts;
        const int64_t row = slab_row + tiles * part / parts * TILE_ROWS;
        const int64_t end_tile = slab_row + tiles * (part + 1) / parts * TILE_ROWS;
        const int64_t end = end_tile < slab_row + slab_rows ? end_tile : slab_row + slab_rows;
        block_rows(x_wide, k, packed + block * panel_elems, limit, bias, out, slab_row, row, end,
                   block * 16);
    }
}

/* The calling thread's buffer for widened rows, kept between calls: a fresh allocation of
 * megabytes per call would be fresh pages, faulted in on every call. */
static float *widened_buffer(size_t floats) {
    static __thread float *buffer = NULL;
    static __thread size_t capacity = 0;
    if (floats > capacity) {
        free(buffer);
        capacity = (floats + 1023) & ~(size_t)1023;
        buffer = aligned_alloc(64, capacity * sizeof(float));
        if (!buffer) capacity = 0;
    }
    return buffer;
}

int avx2_gemm_available(void) { return 1; }

/* The shapes the packing takes: N % 16 == 0, K % 32 == 0; any M >= 1. */
int avx2_linear_supported(int64_t m, int64_t n, int64_t k) {
    return m >= 1 && n >= 16 && k >= 32 && n % 16 == 0 && k % 32 == 0;
}

/* The whole product by the calling team (every thread calls it): slab by slab, the rows
 * widened into x_wide (shared by the team), then each thread's share of the slab's work. */
static void linear_share(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                         const uint16_t *bias, GemmOut rows, int64_t m, int64_t k, float *x_wide) {
    const int me = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t slab = m < SLAB_ROWS ? m : SLAB_ROWS;
    for (int64_t slab_row = 0; slab_row < m; slab_row += slab) {
        const int64_t slab_rows = m - slab_row < slab ? m - slab_row : slab;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < slab_rows; r++) /* widened once, exactly */
            for (int64_t i = 0; i < k; i += 8)
                _mm256_storeu_ps(x_wide + r * k + i,
                                 bf16x8_to_f32(x + (slab_row + r) * x_stride + i));
        slab_share(x_wide, packed, bias, rows, slab_row, slab_rows, k, me, threads);
#pragma omp barrier /* the slab's rows are read by every thread before the next overwrites them */
    }
    if (rows.stream) _mm_sfence(); /* streamed lines visible before the caller reads them */
}

static size_t widened_floats(int64_t m, int64_t k) {
    return (size_t)((m < SLAB_ROWS ? m : SLAB_ROWS) * k);
}

/* x: [m, k] bf16 rows x_stride elements apart; packed: amx_pack_weight of W [n, k]; bias: [n]
 * bf16 or NULL; out: contiguous [m, n], bf16, or with out_f32 float32 (the bf16-rounded values
 * widened). Returns 1 (nothing written) when unsupported or out of memory. */
int avx2_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                     const uint16_t *bias, void *out, int64_t m, int64_t n, int64_t k,
                     int out_f32, int num_threads) {
    if (!avx2_linear_supported(m, n, k)) return 1;
    float *x_wide = widened_buffer(widened_floats(m, k));
    if (!x_wide) return 1;
    const GemmOut rows = {out, n, out_f32, gemm_streams(out, m, n, out_f32), 0};
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    linear_share(x, x_stride, packed, bias, rows, m, k, x_wide);
    return 0;
}

/* The same (bf16 out) as a team function, for the fused decode step; *failed is set when the
 * widened rows' buffer could not be allocated (nothing written). */
void avx2_linear_team(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                      const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k,
                      int *failed) {
    float *x_wide;
#pragma omp single copyprivate(x_wide)
    x_wide = widened_buffer(widened_floats(m, k)); /* the single thread's, lent to the team */
    if (x_wide == NULL) {
#pragma omp atomic write
        *failed = 1;
        return;
    }
    const GemmOut rows = {out, n, 0, 0, 0};
    linear_share(x, x_stride, packed, bias, rows, m, k, x_wide);
}

#else /* no AVX2 and FMA at build time: callers keep oneDNN or F.linear */

int avx2_gemm_available(void) { return 0; }
int avx2_linear_supported(int64_t m, int64_t n, int64_t k) { return 0; }
int avx2_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                     const uint16_t *bias, void *out, int64_t m, int64_t n, int64_t k,
                     int out_f32, int num_threads) {
    return 1;
}
void avx2_linear_team(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                      const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k,
                      int *failed) {
    *failed = 1;
}

#endif
