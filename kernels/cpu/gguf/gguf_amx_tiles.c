/* The bf16 tiles on AMX (the amx_bf16 library; included by gguf_bf16_tiles.c).
 *
 * Why: where the CPU has AMX, the dequantized bf16 path multiplies on the tile unit
 * (gemm_amx.c) and the AVX-512 tiles, VDPBF16PS or float32 FMAs, fell several times behind it
 * from a few rows on (bench/GGUF_FIGURES.md). Here each panel of 32 weight rows is decoded
 * to bf16 (decode_row_values: gguf's own float32 values rounded to nearest even, exactly what
 * the dequantized path holds) and multiplied on the tile unit by the dense AMX GEMM's own
 * column_pair (amx_column_pair.h).
 *
 * The operands swap roles: the decoded weight rows are the row operand, read in place with a
 * tile load's stride, and the activations, packed once per call into the VNNI layout
 * (gemm_pack_tile), are the paired one. So a panel is decoded straight into the buffer the
 * tile unit reads, with no packing per weight tile; the price is a transpose per 16 x 16
 * output tile, fewer by K / 32 than the weight tiles. Each product is the same
 * (w_even x_even + w_odd x_odd, in the same order along K), so the sums are the dense AMX
 * GEMM's on the dequantized weight, bit for bit.
 */
#include "../amx_column_pair.h"

#define AMX_PANEL_ROWS 32 /* weight rows per panel: column_pair's two 16-row blocks */

/* Activation rows per chunk: every panel runs past a chunk of x's rows before the next chunk,
 * so the chunk is read from L2 (2 MB per core on AMX Xeons) rather than from L3 once per panel
 * (the whole x of a 2,048-row prefill at K = 640 is 2.6 MB); the price is one more decode of
 * the weight per chunk. At least 256 rows, though: for long rows (a down projection's
 * K = 8192) decoding the weight once per 64 rows cost more than reading the chunk from L3
 * (bench/GGUF_FIGURES.md). */
#define AMX_CHUNK_BYTES (1 << 20)
#ifndef AMX_CHUNK_MIN_ROWS
#define AMX_CHUNK_MIN_ROWS 256
#endif

static int64_t amx_chunk_rows(int64_t k) {
    const int64_t rows = AMX_CHUNK_BYTES / (2 * k) / 32 * 32;
    return rows < AMX_CHUNK_MIN_ROWS ? AMX_CHUNK_MIN_ROWS : rows;
}

/* x's rows [first_row, first_row + rows) as paired operands: per 16-row block k / 32 tiles,
 * the last block's missing rows zero (from `rows16`, a [16, k] buffer). */
static void pack_amx_rows(const uint16_t *x, int64_t x_stride, int64_t first_row, int64_t rows,
                          int64_t k, uint16_t *rows16, uint16_t *packed) {
    const int64_t kblocks = k / 32, blocks = (rows + 15) / 16;
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *src = x + (first_row + 16 * b) * x_stride;
        int64_t stride = x_stride;
        if (rows - 16 * b < 16) {
            memset(rows16, 0, sizeof(uint16_t) * (size_t)(16 * k));
            for (int64_t r = 0; r < rows - 16 * b; r++)
                memcpy(rows16 + r * k, src + r * x_stride, sizeof(uint16_t) * (size_t)k);
            src = rows16, stride = k;
        }
        for (int64_t kb = 0; kb < kblocks; kb++)
            gemm_pack_tile(src + kb * 32, stride, packed + (b * kblocks + kb) * GEMM_TILE_ELEMS);
    }
}

/* Decodes weight rows [first, first + AMX_PANEL_ROWS) into panel ([32, k] bf16), the last row
 * standing in for rows past n_rows, the next panel's rows fetched into L2 meanwhile. */
static void decode_amx_panel(int type, const uint8_t *w, int64_t row_bytes,
                             const int64_t *row_map, int64_t n_rows, int64_t first, int64_t k,
                             uint16_t *panel) {
    for (int r = 0; r < AMX_PANEL_ROWS; r++) {
        const int64_t at = first + r < n_rows ? first + r : n_rows - 1;
        decode_row_values(type, weight_row(w, row_bytes, row_map, at), k, panel + r * k, 1);
        if (at + AMX_PANEL_ROWS < n_rows) {
            const char *next = (const char *)weight_row(w, row_bytes, row_map,
                                                        at + AMX_PANEL_ROWS);
            for (int64_t line = 0; line < row_bytes; line += 64)
                _mm_prefetch(next + line, _MM_HINT_T1);
        }
    }
}

/* One product tile, sums[weight row][activation row], into y transposed: `rows` activation
 * rows by `cols` weight rows, rounded to bf16 in float32 where asked. */
static void store_transposed(float sums[16][16], int rows, int cols, float *y, int64_t y_stride,
                             int round_to_bf16) {
    float by_row[16][16];
    gemm_pack_tile((const uint16_t *)sums, 32, (uint16_t *)by_row); /* a 32-bit transpose */
    const __mmask16 lanes = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < rows; r++) {
        const __m512 values = _mm512_loadu_ps(by_row[r]);
        _mm512_mask_storeu_ps(y + r * y_stride, lanes,
                              round_to_bf16 ? rounded_to_bf16(values) : values);
    }
}

/* column_pair with one paired block: the panel's two weight blocks against one packed block
 * of activations, into acc[0] and acc[2] (column_pair's places for it). A step of at most 16
 * rows, and an odd block count's last block, would otherwise pay a product with zeros. */
static inline void panel_times_block(const uint16_t *panel, int64_t k, const uint16_t *block,
                                     float (*acc)[16][16]) {
    _tile_zero(0);
    _tile_zero(2);
    for (int64_t kb = 0; kb < k / 32; kb++) {
        _tile_loadd(6, block + kb * GEMM_TILE_ELEMS, 64);
        _tile_loadd(4, panel + kb * 32, k * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, panel + 16 * k + kb * 32, k * 2);
        _tile_dpbf16ps(2, 5, 6);
    }
    _tile_stored(0, acc[0], 64);
    _tile_stored(2, acc[2], 64);
}

/* A decoded panel against a packed chunk of `rows` activation rows: y's rows [0, rows) and
 * columns [0, cols). */
static void panel_through_rows(const uint16_t *panel, const uint16_t *packed, int64_t rows,
                               int64_t k, int cols, float *y, int64_t y_stride,
                               int round_to_bf16) {
    float acc[4][16][16]; /* acc[2 * weight block + activation block] */
    const int64_t kblocks = k / 32, blocks = (rows + 15) / 16;
    for (int64_t b = 0; b < blocks; b += 2) {
        if (b + 1 < blocks)
            column_pair(panel, k * 2, kblocks, packed + b * kblocks * GEMM_TILE_ELEMS, NULL, acc,
                        2);
        else
            panel_times_block(panel, k, packed + b * kblocks * GEMM_TILE_ELEMS, acc);
        for (int a = 0; a < 2 && b + a < blocks; a++) {
            const int64_t row = 16 * (b + a);
            const int in_block = rows - row < 16 ? (int)(rows - row) : 16;
            for (int wb = 0; wb < 2 && 16 * wb < cols; wb++)
                store_transposed(acc[2 * wb + a], in_block, cols - 16 * wb < 16 ? cols - 16 * wb
                                                                                : 16,
                                 y + row * y_stride + 16 * wb, y_stride, round_to_bf16);
        }
    }
}

/* bf16_tiles_team's contract on AMX. Returns 0 where this thread could not allocate its
 * buffers (its panels are skipped). Every thread packs each chunk for itself: a chunk is a
 * small fraction of the weight's bytes, and so no barrier is needed between chunks. */
static int amx_tiles_team(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                          int64_t n_rows, int64_t k, const uint16_t *x, int64_t x_stride,
                          int64_t m_rows, float *y, int64_t y_stride, int round_to_bf16) {
    const int64_t chunk = m_rows < amx_chunk_rows(k) ? m_rows : amx_chunk_rows(k);
    const int64_t chunk_blocks = (chunk + 15) / 16;
    uint16_t *panel = aligned_alloc(64, sizeof(uint16_t) * (size_t)(AMX_PANEL_ROWS * k));
    uint16_t *rows16 = aligned_alloc(64, sizeof(uint16_t) * (size_t)(16 * k));
    uint16_t *packed = aligned_alloc(64, sizeof(uint16_t) * (size_t)(chunk_blocks * 16 * k));
    const int ok = panel != NULL && rows16 != NULL && packed != NULL;
    configure_full_tiles();
    for (int64_t first_row = 0; first_row < m_rows; first_row += chunk) {
        const int64_t rows = m_rows - first_row < chunk ? m_rows - first_row : chunk;
        if (ok) pack_amx_rows(x, x_stride, first_row, rows, k, rows16, packed);
        /* the same panels for every thread in every chunk: no barrier between chunks */
#pragma omp for schedule(static) nowait
        for (int64_t first = 0; first < n_rows; first += AMX_PANEL_ROWS) {
            if (!ok) continue;
            const int cols = (int)(n_rows - first < AMX_PANEL_ROWS ? n_rows - first
                                                                    : AMX_PANEL_ROWS);
            decode_amx_panel(type, w, row_bytes, row_map, n_rows, first, k, panel);
            panel_through_rows(panel, packed, rows, k, cols, y + first_row * y_stride + first,
                               y_stride, round_to_bf16);
        }
    }
    _tile_release();
    free(panel);
    free(rows16);
    free(packed);
#pragma omp barrier
    return ok;
}
