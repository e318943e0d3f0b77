/* gguf_gemm of the AVX-512 library: weight blocks decoded in registers inside the dot product.
 *
 * Included by gguf_gemm.c in the AVX-512 library only (it needs AVX512BW); the AVX2 and
 * portable libraries unpack a tile of weight rows to a buffer instead. With few activation
 * rows (decode) that buffer round trip, not the arithmetic, was the cost; decoding in
 * registers was also faster at every row count measured, so this library has no tile path
 * (and a row's result never depends on how many rows share its call: batch invariance).
 *
 *  - activations: the same two codes per value as the tile path (q1 = round(x / d), q2 =
 *    the remainder at d / RESIDUAL), held as ONE int16 per value, RESIDUAL q1 + q2
 *    (|.| <= 254 * 127 + 127 fits). An int16 x int16 multiply-add (vpmaddwd) then takes a
 *    whole 32-block in one 512-bit instruction, exactly as the two int8 products would, and
 *    signed weights need no sign transfer;
 *  - weights: each 32-block becomes 32 signed int16 in a register: Q4_0's code - 8, Q5_0's
 *    code - 16 and Q6_K's (code - 32) times its int8 scale, so those types (and Q8_0) have
 *    no offset term; Q4_1/Q5_1/Q4_K/Q5_K keep their min, times the block's activation sum;
 *  - per (weight row, activation row, block): one vpmaddwd, one int -> float conversion and
 *    one FMA by the block's factor (weight scale x activation step). The 32-value types read
 *    their fp16 d (and m) in the loop; the K-quants' 6-bit scales and mins are decoded per
 *    super-block into factors and one offset dot per row beforehand;
 *  - ROW_GROUP weight rows by ROW_BATCH activation rows per pass: a decoded block serves
 *    ROW_BATCH activation rows, a loaded activation block serves ROW_GROUP weight rows.
 */

#define ROW_GROUP 4    /* weight rows per pass */
#define ROW_BATCH 4    /* activation rows per pass */
/* Groups ahead whose weight rows are prefetched: a group's rows are short streams (a few
 * hundred bytes each) that the hardware prefetcher picks up too late when weights come from
 * memory; two groups ahead covers the memory latency at the rate a group is consumed. */
#define PREFETCH_GROUPS 2
/* Activation bytes per chunk of rows that every weight group runs through before the next
 * chunk: they stay in L2 while the weights stream past (many rows: prefill, batch-invariant
 * mode). */
#define CHUNK_BYTES (256 << 10)

typedef struct {
    int16_t *value;  /* M x K: RESIDUAL q1 + q2 */
    float *step;     /* M x K/32: d / RESIDUAL, the activation's unit */
    float *sum;      /* M x K/32: step * (sum of the block's values) */
} WideRows;

/* ---- activations ------------------------------------------------------------------------- */

static inline __m512 load16_x(const void *x, int bf16, int64_t index) {
    if (bf16) {  /* bf16 is the top half of a float32 */
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + index);
}

static inline __m512i clamp127(__m512i v) {
    return _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}

/* 16 values -> RESIDUAL q1 + q2 as int32, computed as quantize_row does (round to nearest
 * even, the same order of float operations). */
static inline __m512i two_codes(__m512 values, __m512 d, __m512 inverse) {
    __m512i code = clamp127(_mm512_cvtps_epi32(_mm512_mul_ps(values, inverse)));
    __m512 rest = _mm512_fnmadd_ps(d, _mm512_cvtepi32_ps(code), values);
    rest = _mm512_mul_ps(_mm512_mul_ps(rest, inverse), _mm512_set1_ps((float)RESIDUAL));
    return _mm512_add_epi32(_mm512_mullo_epi32(code, _mm512_set1_epi32(RESIDUAL)),
                            clamp127(_mm512_cvtps_epi32(rest)));
}

static void quantize_wide_row(const void *x, int bf16, int64_t base, int64_t k, int16_t *value,
                              float *step, float *sum) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t block = 0; block < k / 32; block++) {
        __m512 low = load16_x(x, bf16, base + 32 * block);
        __m512 high = load16_x(x, bf16, base + 32 * block + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(low, magnitude),
                                                        _mm512_and_ps(high, magnitude)));
        float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512 dv = _mm512_set1_ps(d), iv = _mm512_set1_ps(inverse);
        __m512i first = two_codes(low, dv, iv), second = two_codes(high, dv, iv);
        _mm256_storeu_si256((__m256i *)(value + 32 * block), _mm512_cvtepi32_epi16(first));
        _mm256_storeu_si256((__m256i *)(value + 32 * block + 16), _mm512_cvtepi32_epi16(second));
        step[block] = d / (float)RESIDUAL;
        sum[block] = step[block] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(first, second));
    }
}

/* ---- weight blocks -> 32 signed int16 ------------------------------------------------------ */

/* 16 bytes -> their low nibbles (values 0..15), then their high nibbles (values 16..31) */
static inline __m512i nibbles16(const uint8_t *qs) {
    __m512i bytes = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)qs)));
    bytes = _mm512_mask_srli_epi16(bytes, 0xFFFF0000u, bytes, 4);
    return _mm512_and_si512(bytes, _mm512_set1_epi16(15));
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    return bits;
}

/* Value j gains 16 where bit j of the 32-bit word at qh is set. */
static inline __m512i add_fifth_bits(__m512i codes, const uint8_t *qh) {
    return _mm512_mask_add_epi16(codes, (__mmask32)load_u32(qh), codes, _mm512_set1_epi16(16));
}

/* Block `index` of a 32-value type, or sub-block `index` (0..7) of a K-quant super-block. */
static inline __m512i decode_block(int type, const uint8_t *b, int index) {
    const __m512i sixteen = _mm512_set1_epi16(16);
    switch (type) {
    case T_Q8_0: return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 2)));
    case T_Q4_0: return _mm512_sub_epi16(nibbles16(b + 2), _mm512_set1_epi16(8));
    case T_Q4_1: return nibbles16(b + 4);
    case T_Q5_0: {  /* code - 16: subtract 16 where the fifth bit is clear */
        __m512i low = nibbles16(b + 6);
        return _mm512_mask_sub_epi16(low, ~(__mmask32)load_u32(b + 2), low, sixteen);
    }
    case T_Q5_1: return add_fifth_bits(nibbles16(b + 8), b + 4);
    case T_Q4_K: case T_Q5_K: {  /* 32 bytes per two sub-blocks: low nibbles, high nibbles */
        const uint8_t *qs = b + (type == T_Q5_K ? 48 : 16) + 32 * (index >> 1);
        __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)qs));
        __m512i codes = (index & 1) ? _mm512_srli_epi16(bytes, 4)
                                    : _mm512_and_si512(bytes, _mm512_set1_epi16(15));
        if (type == T_Q4_K) return codes;
        /* Q5_K: bit `index` of qh[l] tops value l */
        __mmask32 top = _mm256_test_epi8_mask(_mm256_loadu_si256((const __m256i *)(b + 16)),
                                              _mm256_set1_epi8((char)(1 << index)));
        return _mm512_mask_add_epi16(codes, top, codes, sixteen);
    }
    case T_Q6_K: {  /* sub-block 4 h + c: low 4 bits from ql, 2 high bits from qh (unpack_q6_k) */
        int half = index >> 2, quarter = index & 3;
        __m512i low = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            (const __m256i *)(b + 64 * half + 32 * (quarter & 1))));
        __m512i high = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            (const __m256i *)(b + 128 + 32 * half)));
        low = quarter < 2 ? _mm512_and_si512(low, _mm512_set1_epi16(15)) : _mm512_srli_epi16(low, 4);
        /* bits 2c, 2c+1 of qh to bits 4, 5 (index is a constant once the caller is unrolled) */
        high = quarter == 0 ? _mm512_slli_epi16(high, 4) : quarter == 1 ? _mm512_slli_epi16(high, 2)
             : quarter == 2 ? high : _mm512_srli_epi16(high, 2);
        high = _mm512_and_si512(high, _mm512_set1_epi16(0x30));
        __m512i codes = _mm512_sub_epi16(_mm512_or_si512(low, high), _mm512_set1_epi16(32));
        /* the int8 scales of its two 16-value halves: |(code - 32) * scale| <= 4096 */
        __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(
            _mm_loadu_si128((const __m128i *)(b + 192))));
        __m512i pick = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(2 * index)),
                                               _mm512_set1_epi16((short)(2 * index + 1)));
        return _mm512_mullo_epi16(codes, _mm512_permutexvar_epi16(pick, scales));
    }
    default: return _mm512_setzero_si512();
    }
}

static int has_offset(int type) {
    return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K;
}

/* ---- per-block factors: weight scale x activation step, and the offset terms -------------- */

/* What one weight row contributes besides its codes, for `batch` activation rows:
 * factor[m * blocks + b] = the row's scale of block b times row m's step, and
 * offset_dot[m] = sum over blocks of the row's offset times row m's block sum. */
typedef struct {
    const float *step, *sum;  /* the batch's first activation row; row stride `blocks` */
    int batch;
    int64_t blocks;
    float *factor;
    float offset_dot[ROW_BATCH];
} RowFactors;

static inline __mmask16 first_lanes(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
}

/* scale[16] (and offset[16]) of 16 blocks from b on -> factors and offset sums. */
static inline void add_factors(RowFactors *f, int64_t b, __mmask16 lanes, __m512 scale,
                               __m512 offset, __m512 offset_acc[ROW_BATCH], int with_offset) {
    for (int m = 0; m < f->batch; m++) {
        __m512 step = _mm512_maskz_loadu_ps(lanes, f->step + m * f->blocks + b);
        _mm512_mask_storeu_ps(f->factor + m * f->blocks + b, lanes, _mm512_mul_ps(scale, step));
        if (with_offset)
            offset_acc[m] = _mm512_fmadd_ps(
                offset, _mm512_maskz_loadu_ps(lanes, f->sum + m * f->blocks + b), offset_acc[m]);
    }
}

/* Q4_K/Q5_K: the 8 six-bit scales and 8 six-bit mins packed in 12 bytes, as 16 floats
 * [scales, mins]: ggml's get_scale_min_k4 for all 8 sub-blocks at once, on 32-bit words. */
static inline __m512 k4_scales_mins(const uint8_t *packed) {
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    uint32_t u[4];
    memcpy(u, packed, 12);
    u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);  /* mins 4..7 */
    uint32_t mins = u[1] & low6;                                  /* mins 0..3 */
    u[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);          /* scales 4..7 */
    u[2] = mins;
    u[0] &= low6;                                                 /* scales 0..3 */
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u)));
}

/* K-quants: per super-block, its 8 sub-block scales (d x 6-bit scale; Q6_K: d, its int8
 * scales are in the codes) and offsets (-dmin x 6-bit min). */
static void k_block_factors(int type, const uint8_t *w, RowFactors *f,
                            __m512 offset_acc[ROW_BATCH]) {
    int size = block_bytes(type), with_offset = has_offset(type);
    for (int64_t super = 0; super < f->blocks / 8; super++) {
        const uint8_t *b = w + super * size;
        __m512 scale, offset = _mm512_setzero_ps();
        if (type == T_Q6_K) {
            scale = _mm512_set1_ps(half_to_float(b + 208));
        } else {  /* lanes 0-7 scales x d, lanes 8-15 mins x -dmin */
            __m512 both = _mm512_mul_ps(k4_scales_mins(b + 4), _mm512_insertf32x8(
                _mm512_set1_ps(half_to_float(b)), _mm256_set1_ps(-half_to_float(b + 2)), 1));
            scale = both;
            offset = _mm512_shuffle_f32x4(both, both, 0xEE);
        }
        add_factors(f, 8 * super, 0xFF, scale, offset, offset_acc, with_offset);
    }
}

static void row_factors(int type, const uint8_t *w, RowFactors *f) {
    __m512 offset_acc[ROW_BATCH];
    for (int m = 0; m < ROW_BATCH; m++) offset_acc[m] = _mm512_setzero_ps();
    if (type >= T_Q4_K) k_block_factors(type, w, f, offset_acc);

    for (int m = 0; m < f->batch; m++) f->offset_dot[m] = _mm512_reduce_add_ps(offset_acc[m]);
}

/* ---- the pass: ROW_GROUP weight rows x `batch` activation rows --------------------------- */

typedef struct {
    const uint8_t *rows[ROW_GROUP];
    const uint8_t *ahead[ROW_GROUP];  /* rows PREFETCH_GROUPS groups on, read from memory now */
    const float *factor;  /* [ROW_GROUP][batch][K/32]: weight scale x activation step */
    const int16_t *value; /* the first activation row of the batch */
    const float *step, *sum;  /* their steps and block sums */
    int64_t k;
} Pass;

static inline __attribute__((always_inline)) void run_pass(int type, int batch, const Pass *p,
                                                           float out[ROW_GROUP][ROW_BATCH]) {
    const int per = type >= T_Q4_K ? 8 : 1;  /* 32-blocks per stored block */
    const int size = block_bytes(type);
    const int64_t blocks = p->k / 32;
    __m512 acc[ROW_GROUP][ROW_BATCH];
    for (int r = 0; r < ROW_GROUP; r++)
        for (int m = 0; m < batch; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t stored = 0; stored < blocks / per; stored++) {
        for (int r = 0; r < ROW_GROUP; r++)
            for (int line = 0; line < size; line += 64)
                _mm_prefetch((const char *)p->ahead[r] + stored * size + line, _MM_HINT_T0);
#pragma GCC unroll 8
        for (int j = 0; j < per; j++) {
            int64_t block = stored * per + j;
            __m512i w[ROW_GROUP];
            __m512 scale[ROW_GROUP], min[ROW_GROUP];
            for (int r = 0; r < ROW_GROUP; r++) {
                const uint8_t *b = p->rows[r] + stored * size;
                w[r] = decode_block(type, b, j);
                if (per == 1 && has_offset(type)) {  /* fp16 d then m: [d, m, d, m, ...] */
                    __m512 pair = _mm512_cvtph_ps(_mm256_set1_epi32((int)load_u32(b)));
                    scale[r] = _mm512_moveldup_ps(pair);
                    min[r] = _mm512_movehdup_ps(pair);
                } else if (per == 1) {  /* fp16 d */
                    scale[r] = _mm512_cvtph_ps(_mm256_set1_epi16((short)(b[0] | b[1] << 8)));
                }
            }
            for (int m = 0; m < batch; m++) {
                __m512i v = _mm512_loadu_si512(p->value + m * p->k + 32 * block);
                for (int r = 0; r < ROW_GROUP; r++) {
                    __m512 dot = _mm512_cvtepi32_ps(_mm512_madd_epi16(w[r], v));
                    if (per > 1) {  /* the row's factors were computed beforehand */
                        float f = p->factor[(r * batch + m) * blocks + block];
                        acc[r][m] = _mm512_fmadd_ps(dot, _mm512_set1_ps(f), acc[r][m]);
                        continue;
                    }
                    __m512 f = _mm512_mul_ps(scale[r], _mm512_set1_ps(p->step[m * blocks + block]));
                    acc[r][m] = _mm512_fmadd_ps(dot, f, acc[r][m]);
                    if (has_offset(type))  /* m x the block's activation sum, in lane 0 only */
                        acc[r][m] = _mm512_mask3_fmadd_ps(
                            min[r], _mm512_set1_ps(p->sum[m * blocks + block]), acc[r][m], 1);
                }
            }
        }
    }
    for (int r = 0; r < ROW_GROUP; r++)
        for (int m = 0; m < batch; m++) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}

/* One specialised copy per (type, batch): the type's decode and the loop bounds are then
 * constants, and the accumulators stay in registers. */
#define PASS_BATCHES(T)                                    \
    switch (batch) {                                       \
    case 1: run_pass(T, 1, p, out); return;                \
    case 2: run_pass(T, 2, p, out); return;                \
    case 3: run_pass(T, 3, p, out); return;                \
    default: run_pass(T, ROW_BATCH, p, out); return;       \
    }

static void dispatch_pass(int type, int batch, const Pass *p, float out[ROW_GROUP][ROW_BATCH]) {
    switch (type) {
    case T_Q4_0: PASS_BATCHES(T_Q4_0)
    case T_Q4_1: PASS_BATCHES(T_Q4_1)
    case T_Q5_0: PASS_BATCHES(T_Q5_0)
    case T_Q5_1: PASS_BATCHES(T_Q5_1)
    case T_Q8_0: PASS_BATCHES(T_Q8_0)
    case T_Q4_K: PASS_BATCHES(T_Q4_K)
    case T_Q5_K: PASS_BATCHES(T_Q5_K)
    case T_Q6_K: PASS_BATCHES(T_Q6_K)
    }
}

/* Output columns first..first+ROW_GROUP-1 (fewer at the end: the last row stands in for the
 * missing ones and its extra results are dropped) for every activation row. factor: scratch
 * of ROW_GROUP x ROW_BATCH x K/32 floats. */
static void column_group(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                        int64_t n_rows, int64_t first, int64_t k, const WideRows *a,
                        int64_t m_rows, float *y, int64_t y_stride, float *factor) {
    int64_t blocks = k / 32;
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
            f[r] = (RowFactors){a->step + m0 * blocks, a->sum + m0 * blocks, batch, blocks,
                                factor + r * batch * blocks, {0}};
            row_factors(type, p.rows[r], &f[r]);
        }
        p.value = a->value + m0 * k;
        p.step = a->step + m0 * blocks;
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
    WideRows view = {a->value + m0 * k, a->step + m0 * (k / 32), a->sum + m0 * (k / 32)};
    return view;
}

/* gguf_gemm's contract (gguf_gemm.c). */
static int gemm_in_registers(int type, const uint8_t *w, int64_t row_bytes,
                             const int64_t *row_map, int64_t n_rows, int64_t k, const void *x,
                             int x_bf16, int64_t x_stride, int64_t m_rows, float *y,
                             int64_t y_stride, int threads) {
    int64_t blocks = k / 32, chunk = chunk_rows(k);
    WideRows a;
    a.value = malloc(sizeof(int16_t) * (size_t)(m_rows * k));
    a.step = malloc(sizeof(float) * (size_t)(m_rows * blocks));
    a.sum = malloc(sizeof(float) * (size_t)(m_rows * blocks));
    int status = (a.value && a.step && a.sum) ? 0 : 2;
    if (status == 0) {
#pragma omp parallel num_threads(threads)
        {  /* one region: quantize x, then (after the implicit barrier) the column groups */
#pragma omp for schedule(static)
            for (int64_t m = 0; m < m_rows; m++)
                quantize_wide_row(x, x_bf16, m * x_stride, k, a.value + m * k, a.step + m * blocks,
                                  a.sum + m * blocks);
            float *factor = malloc(sizeof(float) * (size_t)(ROW_GROUP * ROW_BATCH * blocks));
            int ok = factor != NULL;
            if (!ok) {
#pragma omp atomic write
                status = 2;
            }
            for (int64_t m0 = 0; m0 < m_rows; m0 += chunk) {
                int64_t rows = m_rows - m0 < chunk ? m_rows - m0 : chunk;
                WideRows part = rows_from(&a, m0, k);
#pragma omp for schedule(static)
                for (int64_t first = 0; first < n_rows; first += ROW_GROUP)
                    if (ok) column_group(type, w, row_bytes, row_map, n_rows, first, k, &part, rows,
                                        y + m0 * y_stride, y_stride, factor);
            }
            free(factor);
        }
    }
    free(a.value); free(a.step); free(a.sum);
    return status;
}
