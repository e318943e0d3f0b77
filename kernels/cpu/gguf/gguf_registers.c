/* gguf_gemm of the AVX-512 and AVX2 libraries: weight blocks decoded in registers inside the
 * dot product. This file holds what both widths share (the blocking, the per-row factors'
 * layout, the team functions gguf_gemm.c's entry points call); gguf_avx512.c and gguf_avx2.c
 * hold the vector code of each, included below by the target flags, so each library is still
 * exactly one path.
 *
 * Included by gguf_gemm.c in those two libraries; the portable one unpacks a tile of weight
 * rows to a buffer instead. With few activation rows (decode) that buffer round trip, not the
 * arithmetic, was the cost; decoding in registers was also faster at every row count
 * measured, so these libraries have no tile path (and a row's result never depends on how
 * many rows share its call: batch invariance).
 *
 *  - activations: the same two codes per value as the tile path (q1 = round(x / d), q2 =
 *    the remainder at d / RESIDUAL), held as ONE int16 per value, RESIDUAL q1 + q2
 *    (|.| <= 254 * 127 + 127 fits). An int16 x int16 multiply-add (vpmaddwd) then takes a
 *    32-block in one 512-bit instruction or two 256-bit ones, exactly as the two int8
 *    products would, and signed weights need no sign transfer;
 *  - weights: each 32-block becomes 32 signed int16 in registers: Q4_0's code - 8, Q5_0's
 *    code - 16 and Q6_K's (code - 32) times its int8 scale, so those types (and Q8_0) have
 *    no offset term; Q4_1/Q5_1/Q4_K/Q5_K keep their min, times the block's activation sum;
 *  - per (weight row, activation row, block): the multiply-adds, one int -> float conversion
 *    and one FMA by the block's factor (weight scale x activation step). The 32-value types
 *    read their fp16 d (and m) in the loop; the K-quants' 6-bit scales and mins are decoded
 *    per super-block into factors and one offset dot per row beforehand;
 *  - except the K-quants in the AVX-512 libraries: their activations take one step per
 *    super-block of 256 (still two codes per value), the sub-block's integer scale multiplies
 *    the codes (vpmullw), and vpdpwssd sums the whole super-block in int32, so the conversion
 *    and the FMA come once per 256 values instead of once per 32 (run_super_pass), which also
 *    decodes each super-block's scales and mins itself (no pass over the row beforehand);
 *  - ROW_GROUP weight rows by ROW_BATCH activation rows per pass: a decoded block serves
 *    ROW_BATCH activation rows, a loaded activation block serves ROW_GROUP weight rows.
 */

#define ROW_GROUP 4    /* weight rows per pass */
#define ROW_BATCH 4    /* activation rows per pass */
/* The same blocking on AVX2, although its 16 vector registers (not 32) cannot hold 16
 * accumulators and 4 decoded blocks: the spilled accumulators stay in L1, and 4 x 2 measured
 * slower from 8 rows on (each decoded block serves fewer products), 2 x 4 no faster. */
/* Groups ahead whose weight rows are prefetched: a group's rows are short streams (a few
 * hundred bytes each) that the hardware prefetcher picks up too late when weights come from
 * memory; two groups ahead covers the memory latency at the rate a group is consumed. Into
 * L2, not L1: two groups of rows at K = 8192 (up to 70 KB) outgrow L1 before they are used,
 * and one thread's decode-time rate from memory measured 3-5% higher so. */
#define PREFETCH_GROUPS 2
/* Activation bytes per chunk of rows that every weight group runs through before the next
 * chunk: they stay in L2 while the weights stream past (many rows: prefill, batch-invariant
 * mode). */
#define CHUNK_BYTES (256 << 10)

typedef struct {
    int16_t *value;  /* M x K: RESIDUAL q1 + q2 */
    float *step;     /* M x K/span: d / RESIDUAL, the activation's unit */
    float *sum;      /* M x K/32: step * (sum of the 32-block's values) */
    int span;        /* values per step: 32, or SUPER_SPAN for the K-quants */
} WideRows;

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    return bits;
}

static int has_offset(int type) {
    return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K;
}

/* What one weight row contributes besides its codes, for `batch` activation rows:
 * factor[m * blocks + b] = the row's scale of block b times row m's step, and
 * offset_dot[m] = sum over blocks of the row's offset times row m's block sum. */
typedef struct {
    const float *step, *sum;  /* the batch's first activation row; row strides `steps`, `blocks` */
    int batch;
    int64_t blocks, steps;
    float *factor;
    float offset_dot[ROW_BATCH];
} RowFactors;

typedef struct {
    const uint8_t *rows[ROW_GROUP];
    const uint8_t *ahead[ROW_GROUP];  /* rows PREFETCH_GROUPS groups on, read from memory now */
    const float *factor;  /* [ROW_GROUP][batch][K/32]: weight scale x activation step */
    const int16_t *value; /* the first activation row of the batch */
    const float *step, *sum;  /* their steps and block sums */
    int64_t k;
} Pass;

/* Q4_K/Q5_K: the 8 six-bit scales and 8 six-bit mins packed in 12 bytes, as 16 bytes
 * [scales, mins]: ggml's get_scale_min_k4 for all 8 sub-blocks at once, on 32-bit words. */
static inline void k4_scales_mins_bytes(const uint8_t *packed, uint8_t out[16]) {
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    uint32_t u[4];
    memcpy(u, packed, 12);
    u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);  /* mins 4..7 */
    uint32_t mins = u[1] & low6;                                  /* mins 0..3 */
    u[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);          /* scales 4..7 */
    u[2] = mins;
    u[0] &= low6;                                                 /* scales 0..3 */
    memcpy(out, u, 16);
}

/* The stored block `stored` of each row PREFETCH_GROUPS groups on: run_pass asks for it while
 * it works on this group's, so it arrives from memory in time. Always inlined: as a call, the
 * pass loop it sits in lost a third of its speed. */
static inline __attribute__((always_inline)) void prefetch_ahead(const Pass *p, int64_t stored,
                                                                 int size) {
    for (int r = 0; r < ROW_GROUP; r++)
        for (int line = 0; line < size; line += 64)
            _mm_prefetch((const char *)p->ahead[r] + stored * size + line, _MM_HINT_T1);
}

/* The vector code of this library's width: quantize_wide_row, row_factors and run_pass. */
#if defined(__AVX512BW__)
#include "gguf_avx512.c"
#else
#include "gguf_avx2.c"
#endif

/* ---- weight rows -> values (row look-ups, dequantized tiles, the bf16 tile path) ---------- */

/* Scales and offsets of the 32-blocks of one stored block (8 for Q4_K and Q5_K, else 1), such
 * that value = scale * decode_block() + offset (Q6_K: store_q6_k_values). */
static inline void block_scales(int type, const uint8_t *b, float scale[8], float offset[8]) {
    switch (type) {
    case T_Q4_K: case T_Q5_K: {
        uint8_t bytes[16];
        k4_scales_mins_bytes(b + 4, bytes);
        float d = half_to_float(b), dmin = half_to_float(b + 2);
#if defined(__AVX512F__)
        /* All 16 in one vector (the same one rounding each): one by one, the byte extractions,
         * conversions and multiplies were a seventh of the bf16 decode's instructions. */
        const __m512 both = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes))),
            _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d), _mm512_set1_ps(-dmin)));
        /* Each half stored by itself: copied out of one 64-byte store, the decode ran slower
         * on Zen 4, likely a load from the store's upper half not forwarded
         * (bench/GGUF_FIGURES.md). */
        const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(both), 1));
        _mm256_storeu_ps(scale, _mm512_castps512_ps256(both));
        _mm256_storeu_ps(offset, upper);
#else
        for (int j = 0; j < 8; j++) {
            scale[j] = d * (float)bytes[j];
            offset[j] = -dmin * (float)bytes[8 + j];
        }
#endif
        return;
    }
    case T_Q4_1: case T_Q5_1: scale[0] = half_to_float(b); offset[0] = half_to_float(b + 2); return;
    default: scale[0] = half_to_float(b); offset[0] = 0.0f; return;
    }
}

/* Stored blocks [from, to) of one weight row (32 values each, 256 for the K-quants) as float32
 * or bf16 at their places in out (out is the row's start). Always inlined into a switch over
 * the types, so that decode_block's type is a constant. */
static inline __attribute__((always_inline)) void decode_run_typed(int type, const uint8_t *row,
                                                                   int64_t from, int64_t to,
                                                                   void *out, int out_bf16) {
    const int per = type >= T_Q4_K ? 8 : 1, size = block_bytes(type);
    if (type == T_Q8_0) {
        for (int64_t stored = from; stored < to; stored++)
            store_q8_0_values(row + stored * size + 2, half_to_float(row + stored * size), out,
                              out_bf16, stored * 32);
        return;
    }
    if (type == T_Q6_K) {
        Q6kReady ready[2];
        if (from < to) q6_k_prepare(row + from * size, &ready[0]);
        for (int64_t stored = from; stored < to; stored++) {
            const int now = (int)((stored - from) & 1);
            if (stored + 1 < to) q6_k_prepare(row + (stored + 1) * size, &ready[!now]);
            store_q6_k_values(&ready[now], out, out_bf16, stored * 256);
        }
        return;
    }
    /* A K-quant block's scales are unpacked one block ahead: from the scalar 6-bit unpacking to
     * the first FMA they are a long chain through memory, which delayed every store of the
     * block it served. The 32-value types' one fp16 scale is read where it is used. */
    const int ahead = per == 8;
    float scales[2][8], offsets[2][8];
    if (ahead && from < to) block_scales(type, row + from * size, scales[0], offsets[0]);
    for (int64_t stored = from; stored < to; stored++) {
        const uint8_t *b = row + stored * size;
        const int now = ahead ? (int)((stored - from) & 1) : 0;
        if (!ahead)
            block_scales(type, b, scales[0], offsets[0]);
        else if (stored + 1 < to)
            block_scales(type, b + size, scales[!now], offsets[!now]);
        const float *scale = scales[now], *offset = offsets[now];
        DecodedBlock codes[8];
        /* Every code of the block before any value is stored: to the compiler a store through
         * out may change the weight bytes, so a load after it is done again (a K-quant's two
         * sub-blocks in the same bytes were widened twice). */
#pragma GCC unroll 8
        for (int j = 0; j < per; j++) codes[j] = decode_block(type, b, j);
        /* Q4_K's and Q5_K's eight scales and offsets read back from memory, each broadcast by
         * its load: kept in one register, each was picked out with a permute, on the port the
         * widenings and look-ups use. */
        __asm__ volatile("" ::: "memory");
#pragma GCC unroll 8
        for (int j = 0; j < per; j++)
            store_block_values_typed(type, codes[j], scale[j], offset[j], out, out_bf16,
                                     (stored * per + j) * 32);
    }
}

/* Stored blocks [from, to) of one weight row as values: what gguf.quants.dequantize gives, in
 * float32 or rounded to bf16 (nearest even, as torch rounds). Every value is one float32
 * rounding of the same exact expression gguf evaluates: a code times its scale is exact in
 * float32 (an fp16 d times a 6-bit scale times a code of at most 5 bits, or Q8_0's d times a
 * byte), so gguf's product and sum round once, as the FMA does; Q6_K's d x (int8 scale x code)
 * may need 25 bits and is rounded once in both. Hence gguf's float32 values bit for bit. */
static void decode_run_values(int type, const uint8_t *row, int64_t from, int64_t to, void *out,
                              int out_bf16) {
    switch (type) {
    case T_Q4_0: decode_run_typed(T_Q4_0, row, from, to, out, out_bf16); return;
    case T_Q4_1: decode_run_typed(T_Q4_1, row, from, to, out, out_bf16); return;
    case T_Q5_0: decode_run_typed(T_Q5_0, row, from, to, out, out_bf16); return;
    case T_Q5_1: decode_run_typed(T_Q5_1, row, from, to, out, out_bf16); return;
    case T_Q8_0: decode_run_typed(T_Q8_0, row, from, to, out, out_bf16); return;
    case T_Q4_K: decode_run_typed(T_Q4_K, row, from, to, out, out_bf16); return;
    case T_Q5_K: decode_run_typed(T_Q5_K, row, from, to, out, out_bf16); return;
    case T_Q6_K: decode_run_typed(T_Q6_K, row, from, to, out, out_bf16); return;
    }
}

/* One weight row of k values at out[0..k) (decode_run_values says what values). */
static void decode_row_values(int type, const uint8_t *row, int64_t k, void *out, int out_bf16) {
    decode_run_values(type, row, 0, k / block_values(type), out, out_bf16);
}

#if defined(__AVX512BF16__)
#include "gguf_bf16_tiles.c"  /* gemm_bf16_tiles: bf16 activations from a few rows on */
#endif

/* One specialised copy per (type, batch): the type's decode and the loop bounds are then
 * constants, and the accumulators stay in registers (most of them, on AVX2). */
#define PASS_BATCHES(T)                                    \
    switch (batch) {                                       \
    case 1: run_pass(T, 1, p, out); return;                \
    case 2: run_pass(T, 2, p, out); return;                \
    case 3: run_pass(T, 3, p, out); return;                \
    default: run_pass(T, ROW_BATCH, p, out); return;       \
    }

#if SUPER_SPAN > 32
#define K_PASS_BATCHES(T)                                  \
    switch (batch) {                                       \
    case 1: run_super_pass(T, 1, p, out); return;          \
    case 2: run_super_pass(T, 2, p, out); return;          \
    case 3: run_super_pass(T, 3, p, out); return;          \
    default: run_super_pass(T, ROW_BATCH, p, out); return; \
    }
#else
#define K_PASS_BATCHES(T) PASS_BATCHES(T)
#endif

static void dispatch_pass(int type, int batch, const Pass *p, float out[ROW_GROUP][ROW_BATCH]) {
    switch (type) {
    case T_Q4_0: PASS_BATCHES(T_Q4_0)
    case T_Q4_1: PASS_BATCHES(T_Q4_1)
    case T_Q5_0: PASS_BATCHES(T_Q5_0)
    case T_Q5_1: PASS_BATCHES(T_Q5_1)
    case T_Q8_0: PASS_BATCHES(T_Q8_0)
    case T_Q4_K: K_PASS_BATCHES(T_Q4_K)
    case T_Q5_K: K_PASS_BATCHES(T_Q5_K)
    case T_Q6_K: K_PASS_BATCHES(T_Q6_K)
    }
}

/* Output columns first..first+ROW_GROUP-1 (fewer at the end: the last row stands in for the
 * missing ones and its extra results are dropped) for every activation row. factor: scratch
 * of ROW_GROUP x ROW_BATCH x K/32 floats. */
static void column_group(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                        int64_t n_rows, int64_t first, int64_t k, const WideRows *a,
                        int64_t m_rows, float *y, int64_t y_stride, float *factor) {
    int64_t blocks = k / 32, steps = k / a->span;
    int rows = (int)(n_rows - first < ROW_GROUP ? n_rows - first : ROW_GROUP);
    Pass p;
    p.k = k;
    p.factor = factor;
    int64_t ahead = first + PREFETCH_GROUPS * ROW_GROUP;
    for (int r = 0; r < ROW_GROUP; r++) {
        p.rows[r] = weight_row(w, row_bytes, row_map, first + (r < rows ? r : rows - 1));
        p.ahead[r] = ahead + r < n_rows ? weight_row(w, row_bytes, row_map, ahead + r) : p.rows[r];
    }
    for (int64_t m0 = 0; m0 < m_rows; m0 += ROW_BATCH) {
        int batch = (int)(m_rows - m0 < ROW_BATCH ? m_rows - m0 : ROW_BATCH);
        RowFactors f[ROW_GROUP];
        for (int r = 0; r < ROW_GROUP; r++) {
            f[r] = (RowFactors){a->step + m0 * steps, a->sum + m0 * blocks, batch, blocks, steps,
                                factor + r * batch * blocks, {0}};
            row_factors(type, p.rows[r], &f[r]);
        }
        p.value = a->value + m0 * k;
        p.step = a->step + m0 * steps;
        p.sum = a->sum + m0 * blocks;
        float out[ROW_GROUP][ROW_BATCH];
        dispatch_pass(type, batch, &p, out);
        for (int m = 0; m < batch; m++)
            for (int r = 0; r < rows; r++)
                y[(m0 + m) * y_stride + first + r] = out[r][m] + f[r].offset_dot[m];
    }
}

static int64_t chunk_rows(int64_t k) {
    int64_t rows = CHUNK_BYTES / (2 * k) / ROW_BATCH * ROW_BATCH;
    return rows > ROW_BATCH ? rows : ROW_BATCH;
}

/* Rows m0.. of the quantized activations. */
static WideRows rows_from(const WideRows *a, int64_t m0, int64_t k) {
    WideRows view = {a->value + m0 * k, a->step + m0 * (k / a->span), a->sum + m0 * (k / 32),
                     a->span};
    return view;
}

/* The activations of either span: the K-quants' passes sum a whole super-block in integers,
 * so their activation rows need one step per super-block (SUPER_SPAN values); the 32-value
 * types keep one per block, the finer grain. A projection quantizes the spans its parts use. */
typedef struct {
    WideRows blocks, supers;
} Activations;

static const WideRows *rows_for(int type, const Activations *a) {
    return SUPER_SPAN > 32 && type >= T_Q4_K ? &a->supers : &a->blocks;
}

static int spans_for(int type) {
    return SUPER_SPAN > 32 && type >= T_Q4_K ? SPANS_SUPERS : SPANS_BLOCKS;
}

/* The activation rows' two codes in a, at the spans asked for (SPANS_*; its arrays hold
 * m_rows rows), the rows shared out among the team (team_ops.h's convention: every thread of
 * the region calls it; it ends in a barrier). */
static void quantize_rows_team(const void *x, int x_bf16, int64_t x_stride, int64_t m_rows,
                               int64_t k, const Activations *a, int spans) {
    const WideRows *kinds[2] = {&a->blocks, &a->supers};
#pragma omp for schedule(static)
    for (int64_t m = 0; m < m_rows; m++)
        for (int i = 0; i < 2; i++) {
            const WideRows *rows = kinds[i];
            if (!(spans & (1 << i)) || k % rows->span) continue;
            quantize_wide_row(x, x_bf16, m * x_stride, k, rows->span, rows->value + m * k,
                              rows->step + m * (k / rows->span), rows->sum + m * (k / 32));
        }
}

/* y's n_rows columns from quantized activation rows, the column groups shared out among the
 * team. Returns 0 where this thread could not allocate its scratch (its groups are skipped). */
static int products_team(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                         int64_t n_rows, int64_t k, const Activations *acts, int64_t m_rows,
                         float *y, int64_t y_stride) {
    const WideRows *a = rows_for(type, acts);
    int64_t chunk = chunk_rows(k);
    float *factor = malloc(sizeof(float) * (size_t)(ROW_GROUP * ROW_BATCH * (k / 32)));
    const int ok = factor != NULL;
    for (int64_t m0 = 0; m0 < m_rows; m0 += chunk) {
        int64_t rows = m_rows - m0 < chunk ? m_rows - m0 : chunk;
        WideRows part = rows_from(a, m0, k);
#pragma omp for schedule(static)
        for (int64_t first = 0; first < n_rows; first += ROW_GROUP)
            if (ok) column_group(type, w, row_bytes, row_map, n_rows, first, k, &part, rows,
                                y + m0 * y_stride, y_stride, factor);
    }
    free(factor);
    return ok;
}

/* Bytes of activation scratch for m_rows rows of K values (both spans' WideRows, each array
 * 64-aligned). */
static int64_t activation_bytes(int64_t m_rows, int64_t k) {
    return 2 * (m_rows * k * 2 + 2 * m_rows * (k / 32) * 4 + 3 * 64);
}

static WideRows wide_rows_at(uintptr_t *at, int64_t m_rows, int64_t k, int span) {
    WideRows rows;
    rows.value = next_array(at, m_rows * k * 2);
    rows.step = next_array(at, m_rows * (k / 32) * 4);
    rows.sum = next_array(at, m_rows * (k / 32) * 4);
    rows.span = span;
    return rows;
}

static Activations activations_at(void *scratch, int64_t m_rows, int64_t k) {
    uintptr_t at = (uintptr_t)scratch;
    Activations a;
    a.blocks = wide_rows_at(&at, m_rows, k, 32);
    a.supers = wide_rows_at(&at, m_rows, k, SUPER_SPAN);
    return a;
}
