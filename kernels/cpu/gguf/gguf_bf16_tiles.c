/* The bf16 tile GEMM of the AVX-512 BF16 library: for bf16 activations from a few rows on.
 *
 * Why: the int kernel (gguf_registers.c) pays a conversion and an FMA on 16 float lanes per
 * 32-block for every (weight row, activation row) pair, three to seven times the bf16 GEMM's
 * time on dequantized weights once a step has more than a handful of rows. Here a tile of
 * BF16_TILE weight rows is decoded once to bf16 (decode_row_values: gguf's own float32 values,
 * rounded to nearest even, i.e. exactly what the dequantized bf16 path holds), into a buffer
 * that stays in L1/L2, and every activation row then runs past it with one VDPBF16PS per
 * 32-block: the arithmetic of the dense bf16 GEMM, with the weight read as stored. The result
 * is the dequantized bf16 path's product up to float32 summation order.
 *
 * A pass keeps BF16_TILE x BF16_BATCH accumulators of 16 partial sums each (lanes along K);
 * one transpose-and-add tree turns the 16 of them into the 16 outputs.
 */

#define BF16_TILE 4   /* weight rows decoded together */
#define BF16_BATCH 4  /* activation rows per pass: BF16_TILE x BF16_BATCH = 16 accumulators */

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

/* Activation rows m0..m0+batch-1 against the decoded tile: y[m, first + r]. */
static inline __attribute__((always_inline)) void bf16_pass(int batch, const uint16_t *tile,
                                                           const uint16_t *x, int64_t x_stride,
                                                           int64_t k, int rows, float *y,
                                                           int64_t y_stride) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t at = 0; at < k; at += 32) {
        __m512bh w[BF16_TILE];
        for (int r = 0; r < BF16_TILE; r++)
            w[r] = (__m512bh)_mm512_loadu_si512(tile + r * k + at);
        for (int m = 0; m < batch; m++) {
            __m512bh v = (__m512bh)_mm512_loadu_si512(x + m * x_stride + at);
            for (int r = 0; r < BF16_TILE; r++)
                acc[m * BF16_TILE + r] = _mm512_dpbf16_ps(acc[m * BF16_TILE + r], w[r], v);
        }
    }
    float sums[16];
    _mm512_storeu_ps(sums, sum_lanes16(acc));
    for (int m = 0; m < batch; m++)
        for (int r = 0; r < rows; r++) y[m * y_stride + r] = sums[m * BF16_TILE + r];
}

/* gguf_gemm's contract, for bf16 x: output columns in tiles of BF16_TILE rows, split between
 * the threads; each tile decoded once and run against all m_rows activation rows. */
static int gemm_bf16_tiles(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                           int64_t n_rows, int64_t k, const uint16_t *x, int64_t x_stride,
                           int64_t m_rows, float *y, int64_t y_stride, int threads) {
    int status = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *tile = aligned_alloc(64, sizeof(uint16_t) * (size_t)(BF16_TILE * k + 32));
        if (!tile) {
#pragma omp atomic write
            status = 2;
        }
#pragma omp for schedule(static)
        for (int64_t first = 0; first < n_rows; first += BF16_TILE) {
            if (!tile) continue;
            int rows = (int)(n_rows - first < BF16_TILE ? n_rows - first : BF16_TILE);
            for (int r = 0; r < BF16_TILE; r++)  /* the last row stands in for missing ones */
                decode_row_values(type, weight_row(w, row_bytes, row_map,
                                                   first + (r < rows ? r : rows - 1)),
                                  k, tile + r * k, 1);
            int64_t m0 = 0;
            for (; m0 + BF16_BATCH <= m_rows; m0 += BF16_BATCH)
                bf16_pass(BF16_BATCH, tile, x + m0 * x_stride, x_stride, k, rows,
                          y + m0 * y_stride + first, y_stride);
            switch (m_rows - m0) {  /* the rest, each count its own copy of the loop */
            case 1: bf16_pass(1, tile, x + m0 * x_stride, x_stride, k, rows,
                              y + m0 * y_stride + first, y_stride); break;
            case 2: bf16_pass(2, tile, x + m0 * x_stride, x_stride, k, rows,
                              y + m0 * y_stride + first, y_stride); break;
            case 3: bf16_pass(3, tile, x + m0 * x_stride, x_stride, k, rows,
                              y + m0 * y_stride + first, y_stride); break;
            }
        }
        free(tile);
    }
    return status;
}
