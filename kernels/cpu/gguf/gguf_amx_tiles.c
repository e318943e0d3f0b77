/* The bf16 tiles on AMX (the amx_bf16 library; included by gguf_bf16_tiles.c).
 *
 * Why: where the CPU has AMX, the dequantized bf16 path multiplies on the tile unit
 * (gemm_amx.c) and the AVX-512 tiles, VDPBF16PS or float32 FMAs, fell several times behind it
 * from a few rows on (bench/GGUF_FIGURES.md). Here each panel of 32 weight rows is decoded
 * to bf16 (decode_run_values: gguf's own float32 values rounded to nearest even, exactly what
 * the dequantized path holds) and multiplied on the tile unit with the dense AMX GEMM's
 * products (column_pair's, amx_column_pair.h), while the vector units decode the next panel.
 *
 * The operands swap roles: the decoded weight rows are the row operand, read in place with a
 * tile load's stride, and the activations, packed once per call into the VNNI layout
 * (gemm_pack_tile), are the paired one. So a panel is decoded straight into the buffer the
 * tile unit reads, with no packing per weight tile; the price is a transpose per 16 x 16
 * output tile, fewer by K / 32 than the weight tiles. Each product is the same
 * (w_even x_even + w_odd x_odd, in the same order along K), so the sums are the dense AMX
 * GEMM's on the dequantized weight, bit for bit.
 */
#include "../gemm_common.h"

#define AMX_PANEL_ROWS 32 /* weight rows per panel: column_pair's two 16-row blocks */

/* Elements from one panel row to the next: k and one cache line more. A tile load reads 16
 * rows at this stride; at k's own (4 KB for k = 2048) all 16 lines fall in one L1 set, more
 * than its ways, and the same calls measured 4-17% slower (bench/GGUF_FIGURES.md). */
#ifndef AMX_PANEL_PAD
#define AMX_PANEL_PAD 32
#endif
static inline int64_t panel_stride(int64_t k) { return k + AMX_PANEL_PAD; }

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

/* A panel of AMX_PANEL_ROWS weight rows, [32, k] bf16, decoded a few stored blocks at a time,
 * so that the decode can be spread over the previous panel's tile products: the decode runs on
 * the vector units and the products on the tile unit, and interleaved they overlap where, one
 * after the other, they took turns. The last weight row stands in for rows past n_rows. */
typedef struct {
    int type;
    const uint8_t *w;
    int64_t row_bytes;
    const int64_t *row_map;
    int64_t n_rows, first, k;
    uint16_t *panel;
    int64_t from, to; /* the run of K decoded, in stored blocks of each row: [from, to) */
    int row;          /* the next stored block to decode: its row, and its place in the row */
    int64_t stored;
    int64_t credit;   /* decode_paced's pacing */
} PanelDecode;

/* The panel of weight rows [first, first + AMX_PANEL_ROWS), inputs [k0, k1), into `panel`
 * (whose rows keep their full length: a run's values go to their own columns). */
static PanelDecode panel_decode(int type, const uint8_t *w, int64_t row_bytes,
                                const int64_t *row_map, int64_t n_rows, int64_t first, int64_t k,
                                int64_t k0, int64_t k1, uint16_t *panel) {
    const int64_t from = k0 / block_values(type);
    return (PanelDecode){type, w, row_bytes, row_map, n_rows, first, k, panel,
                         from, k1 / block_values(type), 0, from, 0};
}

/* The next `count` stored blocks (in row order); as a row starts, the same run of the same row
 * of the panel after this one is fetched into L2, so that it arrives from memory by the time
 * it is decoded. */
static void decode_stored(PanelDecode *d, int64_t count) {
    const int64_t bytes_per_block = d->row_bytes / (d->k / block_values(d->type));
    while (count > 0 && d->row < AMX_PANEL_ROWS) {
        const int64_t at = d->first + d->row < d->n_rows ? d->first + d->row : d->n_rows - 1;
        if (d->stored == d->from && at + AMX_PANEL_ROWS < d->n_rows) {
            const char *ahead = (const char *)weight_row(d->w, d->row_bytes, d->row_map,
                                                         at + AMX_PANEL_ROWS);
            for (int64_t line = d->from * bytes_per_block; line < d->to * bytes_per_block;
                 line += 64)
                _mm_prefetch(ahead + line, _MM_HINT_T1);
        }
        const int64_t to = d->stored + count < d->to ? d->stored + count : d->to;
        decode_run_values(d->type, weight_row(d->w, d->row_bytes, d->row_map, at), d->stored, to,
                          d->panel + d->row * panel_stride(d->k), 1);
        count -= to - d->stored;
        d->stored = to;
        if (d->stored == d->to) d->stored = d->from, d->row++;
    }
}

static void decode_rest(PanelDecode *d) { decode_stored(d, AMX_PANEL_ROWS * (d->to - d->from)); }

/* One step of `steps` over which the whole panel is to be decoded: its stored blocks / steps,
 * the remainder spread evenly (no division per step). */
static inline void decode_paced(PanelDecode *d, int64_t steps) {
    int64_t due = 0;
    for (d->credit += AMX_PANEL_ROWS * (d->to - d->from); d->credit >= steps; d->credit -= steps)
        due++;
    if (due) decode_stored(d, due);
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

/* The panel's two 16-row weight blocks against one or two packed 16-row blocks of activations
 * (column_pair's products, in its places: acc[2 * weight block + activation block]) over k
 * blocks [kb0, kb1), the next panel's decode advanced after each step along K; the sums go on
 * from acc where kb0 > 0 (an earlier run of K), else from zero. One block: a step of at most
 * 16 rows, or an odd block count's last block, pays no product with zeros. Each sum takes its
 * products in the same order along K as column_pair's, so the same bits. */
static inline __attribute__((always_inline)) void panel_times_blocks(
        const uint16_t *panel, int64_t k, int64_t kb0, int64_t kb1, const uint16_t *packed,
        int blocks, float (*acc)[16][16], PanelDecode *next, int64_t steps) {
    const int64_t kblocks = k / 32;
    if (kb0 > 0) {
        _tile_loadd(0, acc[0], 64);
        _tile_loadd(2, acc[2], 64);
        if (blocks > 1) {
            _tile_loadd(1, acc[1], 64);
            _tile_loadd(3, acc[3], 64);
        }
    } else {
        _tile_zero(0);
        _tile_zero(2);
        if (blocks > 1) {
            _tile_zero(1);
            _tile_zero(3);
        }
    }
    for (int64_t kb = kb0; kb < kb1; kb++) {
        _tile_loadd(6, packed + kb * GEMM_TILE_ELEMS, 64);
        if (blocks > 1) _tile_loadd(7, packed + (kblocks + kb) * GEMM_TILE_ELEMS, 64);
        _tile_loadd(4, panel + kb * 32, panel_stride(k) * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (blocks > 1) _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, panel + 16 * panel_stride(k) + kb * 32, panel_stride(k) * 2);
        _tile_dpbf16ps(2, 5, 6);
        if (blocks > 1) _tile_dpbf16ps(3, 5, 7);
        if (next) decode_paced(next, steps);
    }
    _tile_stored(0, acc[0], 64);
    _tile_stored(2, acc[2], 64);
    if (blocks > 1) {
        _tile_stored(1, acc[1], 64);
        _tile_stored(3, acc[3], 64);
    }
}

/* A panel decoded over inputs [k0, k1) against a packed chunk of `rows` activation rows, each
 * pair of row blocks' sums in sums[4 * pair] (carried from the run before and to the next);
 * after K's last run, y's rows [0, rows) and columns [0, cols). Meanwhile the next panel
 * (where there is one) is decoded whole. */
static void panel_through_rows(const uint16_t *panel, const uint16_t *packed, int64_t rows,
                               int64_t k, int64_t k0, int64_t k1, float (*sums)[16][16], int cols,
                               float *y, int64_t y_stride, int round_to_bf16,
                               PanelDecode *next) {
    const int64_t kblocks = k / 32, blocks = (rows + 15) / 16;
    const int64_t steps = (blocks + 1) / 2 * ((k1 - k0) / 32);
    for (int64_t b = 0; b < blocks; b += 2) {
        const uint16_t *pair = packed + b * kblocks * GEMM_TILE_ELEMS;
        float (*acc)[16][16] = sums + 2 * b;
        if (b + 1 < blocks)
            panel_times_blocks(panel, k, k0 / 32, k1 / 32, pair, 2, acc, next, steps);
        else
            panel_times_blocks(panel, k, k0 / 32, k1 / 32, pair, 1, acc, next, steps);
        if (k1 < k) continue;
        for (int a = 0; a < 2 && b + a < blocks; a++) {
            const int64_t row = 16 * (b + a);
            const int in_block = rows - row < 16 ? (int)(rows - row) : 16;
            for (int wb = 0; wb < 2 && 16 * wb < cols; wb++)
                store_transposed(acc[2 * wb + a], in_block, cols - 16 * wb < 16 ? cols - 16 * wb
                                                                                : 16,
                                 y + row * y_stride + 16 * wb, y_stride, round_to_bf16);
        }
    }
    if (next) decode_rest(next); /* a guard: the pacing has decoded every row by now */
}

/* Long rows are taken in runs of this many inputs, every panel of the thread's share through
 * one run before the next (the dense AMX GEMM's order, gemm_amx.c): a whole panel of a down
 * projection's K = 8,192 (512 KB decoded), the next one decoded beside it and a chunk's
 * activations outgrew the 2 MB L2; a run's panel is 128 KB. A multiple of every type's block. */
#define AMX_RUN_VALUES 2048

/* The thread's work as items (run of K, panel), runs outermost: item i's run and panel. */
typedef struct {
    int64_t begin, share, run_values, k;
} ItemOrder;

static inline int64_t item_panel(ItemOrder o, int64_t i) { return o.begin + i % o.share; }
static inline int64_t item_k0(ItemOrder o, int64_t i) { return i / o.share * o.run_values; }
static inline int64_t item_k1(ItemOrder o, int64_t i) {
    const int64_t k1 = item_k0(o, i) + o.run_values;
    return k1 < o.k ? k1 : o.k;
}

/* bf16_tiles_team's contract on AMX. Returns 0 where this thread could not allocate its
 * buffers (its panels are skipped). Each thread takes a contiguous run of panels (as a static
 * schedule would). Every thread packs each chunk for itself: a chunk is a small fraction of
 * the weight's bytes, and so no barrier is needed between chunks. Each item is multiplied
 * while the next is decoded, into the other of two panel buffers. */
static int amx_tiles_team(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                          int64_t n_rows, int64_t k, const uint16_t *x, int64_t x_stride,
                          int64_t m_rows, float *y, int64_t y_stride, int round_to_bf16) {
    const int64_t chunk = m_rows < amx_chunk_rows(k) ? m_rows : amx_chunk_rows(k);
    const int64_t chunk_blocks = (chunk + 15) / 16, pairs = (chunk_blocks + 1) / 2;
    const int64_t panels = (n_rows + AMX_PANEL_ROWS - 1) / AMX_PANEL_ROWS;
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t begin = panels * thread / threads, end = panels * (thread + 1) / threads;
    const ItemOrder order = {begin, end - begin, k < AMX_RUN_VALUES ? k : AMX_RUN_VALUES, k};
    const int64_t items = (k + order.run_values - 1) / order.run_values * order.share;
    const size_t panel_elems = (size_t)(AMX_PANEL_ROWS * panel_stride(k));
    /* every panel's sums, carried from one run of K to the next */
    const size_t sums_tiles = (size_t)((items > order.share ? order.share : 1) * pairs * 4);
    uint16_t *buffers = aligned_alloc(64, sizeof(uint16_t) * 2 * panel_elems);
    uint16_t *rows16 = aligned_alloc(64, sizeof(uint16_t) * (size_t)(16 * k));
    uint16_t *packed = aligned_alloc(64, sizeof(uint16_t) * (size_t)(chunk_blocks * 16 * k));
    float (*sums)[16][16] = aligned_alloc(64, sums_tiles * sizeof(float[16][16]));
    const int ok = buffers != NULL && rows16 != NULL && packed != NULL && sums != NULL;
    configure_full_tiles();
    for (int64_t first_row = 0; ok && items > 0 && first_row < m_rows; first_row += chunk) {
        const int64_t rows = m_rows - first_row < chunk ? m_rows - first_row : chunk;
        pack_amx_rows(x, x_stride, first_row, rows, k, rows16, packed);
        for (int64_t i = 0; i < items; i++) {
            const int64_t p = item_panel(order, i), first = p * AMX_PANEL_ROWS;
            uint16_t *panel = buffers + (size_t)(i & 1) * panel_elems;
            if (i == 0) {  /* else decoded during the item before */
                PanelDecode whole = panel_decode(type, w, row_bytes, row_map, n_rows, first, k,
                                                 item_k0(order, i), item_k1(order, i), panel);
                decode_rest(&whole);
            }
            PanelDecode next = panel_decode(type, w, row_bytes, row_map, n_rows,
                                            item_panel(order, i + 1) * AMX_PANEL_ROWS, k,
                                            item_k0(order, i + 1), item_k1(order, i + 1),
                                            buffers + (size_t)((i + 1) & 1) * panel_elems);
            const int cols = (int)(n_rows - first < AMX_PANEL_ROWS ? n_rows - first
                                                                    : AMX_PANEL_ROWS);
            float (*panel_sums)[16][16] =
                items > order.share ? sums + (p - begin) * pairs * 4 : sums;
            panel_through_rows(panel, packed, rows, k, item_k0(order, i), item_k1(order, i),
                               panel_sums, cols, y + first_row * y_stride + first, y_stride,
                               round_to_bf16, i + 1 < items ? &next : NULL);
        }
    }
    _tile_release();
    free(buffers);
    free(rows16);
    free(packed);
    free(sums);
#pragma omp barrier
    return ok;
}
