/* The AVX-512 vector code of the register kernel (gguf_registers.c, which includes this file
 * and describes the design): a 32-block is one 512-bit vector of int16, one vpmaddwd. */

/* Activation steps per 256 values for the K-quants (run_super_pass), per 32 for the others. */
#define SUPER_SPAN 256

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

/* The largest magnitude of x[base .. base + count), count a multiple of 32. */
static float amax_of(const void *x, int bf16, int64_t base, int64_t count) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 top = _mm512_setzero_ps();
    for (int64_t at = 0; at < count; at += 16)
        top = _mm512_max_ps(top, _mm512_and_ps(load16_x(x, bf16, base + at), magnitude));
    return _mm512_reduce_max_ps(top);
}

/* One row of k values -> RESIDUAL q1 + q2 per value, one step per `span` values (32, or 256
 * for the K-quants' integer sums: gguf_registers.c) and the sum of each 32-block. */
static void quantize_wide_row(const void *x, int bf16, int64_t base, int64_t k, int span,
                              int16_t *value, float *step, float *sum) {
    for (int64_t group = 0; group < k / span; group++) {
        float amax = amax_of(x, bf16, base + group * span, span);
        float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512 dv = _mm512_set1_ps(d), iv = _mm512_set1_ps(inverse);
        step[group] = d / (float)RESIDUAL;
        for (int64_t block = group * (span / 32); block < (group + 1) * (span / 32); block++) {
            __m512i first = two_codes(load16_x(x, bf16, base + 32 * block), dv, iv);
            __m512i second = two_codes(load16_x(x, bf16, base + 32 * block + 16), dv, iv);
            _mm256_storeu_si256((__m256i *)(value + 32 * block), _mm512_cvtepi32_epi16(first));
            _mm256_storeu_si256((__m256i *)(value + 32 * block + 16),
                                _mm512_cvtepi32_epi16(second));
            sum[block] = step[group] *
                         (float)_mm512_reduce_add_epi32(_mm512_add_epi32(first, second));
        }
    }
}

/* ---- weight blocks -> 32 signed int16 ------------------------------------------------------ */

typedef __m512i DecodedBlock;  /* what decode_block gives: 32 int16 */

/* 16 bytes -> their low nibbles (values 0..15), then their high nibbles (values 16..31) */
static inline __m512i nibbles16(const uint8_t *qs) {
    __m512i bytes = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)qs)));
    bytes = _mm512_mask_srli_epi16(bytes, 0xFFFF0000u, bytes, 4);
    return _mm512_and_si512(bytes, _mm512_set1_epi16(15));
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

/* ---- per-row factors: none here ----------------------------------------------------------- */

/* Nothing to do beforehand (the AVX2 library's passes read factors computed here): the
 * 32-value types read their scales in run_pass, and the K-quants' super-block factors come
 * inside run_super_pass (super_block_factors). */
static void row_factors(int type, const uint8_t *w, RowFactors *f) {
    (void)type;
    (void)w;
    for (int m = 0; m < f->batch; m++) f->offset_dot[m] = 0.0f;
}

/* ---- the passes: ROW_GROUP weight rows x `batch` activation rows -------------------------- */

/* The 32-value types: per block, the multiply-adds, one conversion and one FMA by the weight's
 * scale times the activation's step (and the min times the block's sum). */
static inline __attribute__((always_inline)) void run_pass(int type, int batch, const Pass *p,
                                                           float out[ROW_GROUP][ROW_BATCH]) {
    const int size = block_bytes(type);
    const int64_t blocks = p->k / 32;
    __m512 acc[ROW_GROUP][ROW_BATCH];
    for (int r = 0; r < ROW_GROUP; r++)
        for (int m = 0; m < batch; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t block = 0; block < blocks; block++) {
        prefetch_ahead(p, block, size);
        __m512i w[ROW_GROUP];
        __m512 scale[ROW_GROUP], min[ROW_GROUP];
        for (int r = 0; r < ROW_GROUP; r++) {
            const uint8_t *b = p->rows[r] + block * size;
            w[r] = decode_block(type, b, 0);
            if (has_offset(type)) {  /* fp16 d then m: [d, m, d, m, ...] */
                __m512 pair = _mm512_cvtph_ps(_mm256_set1_epi32((int)load_u32(b)));
                scale[r] = _mm512_moveldup_ps(pair);
                min[r] = _mm512_movehdup_ps(pair);
            } else {  /* fp16 d */
                scale[r] = _mm512_cvtph_ps(_mm256_set1_epi16((short)(b[0] | b[1] << 8)));
            }
        }
        for (int m = 0; m < batch; m++) {
            __m512i v = _mm512_loadu_si512(p->value + m * p->k + 32 * block);
            for (int r = 0; r < ROW_GROUP; r++) {
                __m512 dot = _mm512_cvtepi32_ps(_mm512_madd_epi16(w[r], v));
                __m512 f = _mm512_mul_ps(scale[r], _mm512_set1_ps(p->step[m * blocks + block]));
                acc[r][m] = _mm512_fmadd_ps(dot, f, acc[r][m]);
                if (has_offset(type))  /* m x the block's activation sum, in lane 0 only */
                    acc[r][m] = _mm512_mask3_fmadd_ps(
                        min[r], _mm512_set1_ps(p->sum[m * blocks + block]), acc[r][m], 1);
            }
        }
    }
    for (int r = 0; r < ROW_GROUP; r++)
        for (int m = 0; m < batch; m++) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}

/* One super-block of one weight row, what its pass needs besides the codes: d, the
 * Q4_K/Q5_K 6-bit sub-block scales as int16 pairs (Q6_K's int8 scales are applied by
 * decode_block) and their offsets -dmin x 6-bit min in the low 8 lanes. Computed in the pass
 * rather than in a loop over the row beforehand: there its header reads waited on memory
 * alone and its results went through memory, a fifth of the kernel's time at one activation
 * row (batch-1 decode); here they overlap the codes' work. */
static inline __attribute__((always_inline)) float super_block_factors(
    int type, const uint8_t *b, int32_t scales[8], __m512 *offsets) {
    if (type == T_Q6_K) return half_to_float(b + 208);
    uint8_t bytes[16];
    k4_scales_mins_bytes(b + 4, bytes);
    __m256i six_bit = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    _mm256_storeu_si256((__m256i *)scales, _mm256_or_si256(six_bit, _mm256_slli_epi32(six_bit, 16)));
    *offsets = _mm512_castps256_ps512(_mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8)))),
        _mm256_set1_ps(-half_to_float(b + 2))));
    return half_to_float(b);
}

/* The K-quants, on activations with one step per super-block: each sub-block's codes times
 * its integer scale (Q4_K/Q5_K's 6-bit one here, Q6_K's int8 ones in decode_block) go into
 * one int32 sum per super-block by vpdpwssd, converted and scaled once per super-block, where
 * the 32-value types pay a conversion and an FMA per block; the offsets (Q4_K/Q5_K's mins
 * times the activation rows' 32-block sums) join the same accumulators in their low 8 lanes.
 * No int32 lane overflows: a lane sums 16 products of at most 32 x 128 (Q6_K) times
 * 254 x 127 + 127, 2,122,137,600 < 2^31. */
static inline __attribute__((always_inline)) void run_super_pass(
    int type, int batch, const Pass *p, float out[ROW_GROUP][ROW_BATCH]) {
    const int size = block_bytes(type);
    const int64_t blocks = p->k / 32, supers = p->k / 256;
    __m512 acc[ROW_GROUP][ROW_BATCH];
    for (int r = 0; r < ROW_GROUP; r++)
        for (int m = 0; m < batch; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t stored = 0; stored < supers; stored++) {
        prefetch_ahead(p, stored, size);
        int32_t scales[ROW_GROUP][8];
        __m512 offsets[ROW_GROUP];
        float d[ROW_GROUP];
        for (int r = 0; r < ROW_GROUP; r++)
            d[r] = super_block_factors(type, p->rows[r] + stored * size, scales[r], &offsets[r]);
        /* One activation row alone alternates two sums per weight row (odd and even blocks):
         * a single chain of vpdpwssd per row waits on its latency. */
        const int chains = batch == 1 ? 2 : batch;
        __m512i sums[ROW_GROUP][ROW_BATCH];
        for (int r = 0; r < ROW_GROUP; r++)
            for (int m = 0; m < chains; m++) sums[r][m] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m512i w[ROW_GROUP];
            for (int r = 0; r < ROW_GROUP; r++) {
                w[r] = decode_block(type, p->rows[r] + stored * size, j);
                if (type != T_Q6_K)
                    w[r] = _mm512_mullo_epi16(w[r], _mm512_set1_epi32(scales[r][j]));
            }
            for (int m = 0; m < batch; m++) {
                __m512i v = _mm512_loadu_si512(p->value + m * p->k + 256 * stored + 32 * j);
                const int chain = batch == 1 ? (j & 1) : m;
                for (int r = 0; r < ROW_GROUP; r++)
                    sums[r][chain] = _mm512_dpwssd_epi32(sums[r][chain], w[r], v);
            }
        }
        if (batch == 1)
            for (int r = 0; r < ROW_GROUP; r++) sums[r][0] = _mm512_add_epi32(sums[r][0], sums[r][1]);
        for (int m = 0; m < batch; m++) {
            const float step = p->step[m * supers + stored];
            const __m512 block_sums = has_offset(type)
                ? _mm512_maskz_loadu_ps(0xff, p->sum + m * blocks + 8 * stored) : _mm512_setzero_ps();
            for (int r = 0; r < ROW_GROUP; r++) {
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][m]),
                                            _mm512_set1_ps(d[r] * step), acc[r][m]);
                if (has_offset(type))
                    acc[r][m] = _mm512_fmadd_ps(offsets[r], block_sums, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < ROW_GROUP; r++)
        for (int m = 0; m < batch; m++) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}

/* ---- decoded blocks -> float32 or bf16 values ---------------------------------------------- */

/* 16 floats -> 16 bf16, rounded to nearest even as torch does (NaN kept a quiet NaN). */
static inline __m256i round_to_bf16(__m512 values) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(values);
#else
    __m512i bits = _mm512_castps_si512(values);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16),
                                   _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(rounded);
#endif
}

/* 32 int16 codes -> scale * code + offset at out[at..at+32) in float32 or bf16 (decode_run_values
 * in gguf_registers.c says why this gives gguf's values bit for bit). */
static inline void store_values32(__m512 low, __m512 high, void *out, int out_bf16, int64_t at) {
    if (out_bf16) {
        uint16_t *dst = (uint16_t *)out + at;
#if defined(__AVX512BF16__)
        _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(high, low));
#else
        _mm256_storeu_si256((__m256i *)dst, round_to_bf16(low));
        _mm256_storeu_si256((__m256i *)(dst + 16), round_to_bf16(high));
#endif
    } else {
        _mm512_storeu_ps((float *)out + at, low);
        _mm512_storeu_ps((float *)out + at + 16, high);
    }
}

static inline void store_block_values(__m512i codes, float scale_value, float offset_value,
                                      void *out, int out_bf16, int64_t at) {
    const __m512 scale = _mm512_set1_ps(scale_value), offset = _mm512_set1_ps(offset_value);
    store_values32(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
                       _mm512_castsi512_si256(codes))), scale, offset),
                   _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
                       _mm512_extracti64x4_epi64(codes, 1))), scale, offset),
                   out, out_bf16, at);
}

/* A Q8_0 block's 32 signed bytes -> scale * code (+ 0, as store_block_values adds Q8_0's zero
 * offset: the same bits, the sign of a zero included) widened straight to int32, without the
 * int16 step decode_block takes for the int kernel: two lane-crossing widenings per block
 * instead of four (the decode of every weight of the LM head each step, in the tiles). */
static inline void store_q8_0_values(const uint8_t *codes, float scale_value, void *out,
                                     int out_bf16, int64_t at) {
    const __m512 scale = _mm512_set1_ps(scale_value), zero = _mm512_setzero_ps();
    store_values32(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                       _mm_loadu_si128((const __m128i *)codes))), scale, zero),
                   _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                       _mm_loadu_si128((const __m128i *)(codes + 16)))), scale, zero),
                   out, out_bf16, at);
}

/* A Q6_K super-block's 256 values at out[at..at+256). Not from decode_block's int16 codes:
 * there each 32 values took two lane-crossing byte -> word widenings, a scale permute, an
 * int16 multiply and two word -> dword widenings, twice the vector operations of this. Here
 * the 6-bit codes are built as bytes, 64 per operation and within lanes, and each 16 go
 * byte -> dword in one widening, then value = code x f - 32 f with f = d x the int8 scale of
 * those 16 (exact in float32: an fp16 times an int8), in one FMA: its one rounding of the
 * exact (code - 32) x f is gguf's (d x scale) x (code - 32), the same bits (zero as +0, as
 * before). The codes and factors of a block are prepared while the block before it is stored
 * (decode_run_typed): read back right after their own stores, each load waited on them. */
typedef struct {  /* each value's 6-bit code as a byte; per 16 values f and -32 f */
    __attribute__((aligned(64))) uint8_t codes[256];
    __attribute__((aligned(64))) float factor[16], shift[16];
} Q6kReady;

static inline void q6_k_prepare(const uint8_t *b, Q6kReady *q) {
    const __m512 f = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))),
        _mm512_set1_ps(half_to_float(b + 208)));
    _mm512_store_ps(q->factor, f);
    _mm512_store_ps(q->shift, _mm512_mul_ps(f, _mm512_set1_ps(-32.0f)));
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    /* per word: the shifts that bring qh's bits (0,1) / (2,3) resp. (4,5) / (6,7) to bits 4, 5
     * of each byte, for the first / second 32 bytes of a 64-byte ql run */
    const __m512i up = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(4),
                                               _mm512_set1_epi16(2));
    const __m512i down = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_setzero_si512(),
                                                 _mm512_set1_epi16(2));
    for (int half = 0; half < 2; half++) {  /* values 128 half .. +128 */
        const __m512i ql = _mm512_loadu_si512(b + 64 * half);
        const __m512i qh = _mm512_broadcast_i64x4(
            _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half)));
        /* (A & B) | C: low bits from ql's nibbles, the top two from qh */
        _mm512_store_si512(q->codes + 128 * half, _mm512_ternarylogic_epi32(
            ql, low4, _mm512_and_si512(_mm512_sllv_epi16(qh, up), top2), 0xEA));
        _mm512_store_si512(q->codes + 128 * half + 64, _mm512_ternarylogic_epi32(
            _mm512_srli_epi16(ql, 4), low4, _mm512_and_si512(_mm512_srlv_epi16(qh, down), top2),
            0xEA));
    }
}

static inline void store_q6_k_values(const Q6kReady *q, void *out, int out_bf16, int64_t at) {
    /* Read back from memory: a broadcast or a widening from a load costs no shuffle, while
     * the compiler, seeing the values in registers, would pick each out with a permute (port
     * 5, where the widenings already queue). */
    __asm__ volatile("" ::: "memory");
#pragma GCC unroll 8
    for (int pair = 0; pair < 8; pair++) {
        __m512 v[2];
        for (int i = 0; i < 2; i++) {
            const int group = 2 * pair + i;  /* of 16 values: its scale's index */
            const __m128i bytes = _mm_load_si128((const __m128i *)(q->codes + 16 * group));
            v[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)),
                                   _mm512_set1_ps(q->factor[group]),
                                   _mm512_set1_ps(q->shift[group]));
        }
        store_values32(v[0], v[1], out, out_bf16, at + 32 * pair);
    }
}

/* 4- and 5-bit types to bf16 by table: a block's 16 or 32 possible values are computed (the
 * same FMA, so the same bits) and rounded once, and every code picks its value with one word
 * permute, in place of widening, converting and scaling each code (fewer operations per block
 * where the bf16 tiles decode every weight of a step). */
static inline int table_entries(int type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q4_K: return 16;
    case T_Q5_0: case T_Q5_1: case T_Q5_K: return 32;
    default: return 0;
    }
}

static inline int code_base(int type) {  /* decode_block's code minus the table index */
    return type == T_Q4_0 ? -8 : type == T_Q5_0 ? -16 : 0;
}

static inline void store_block_values_typed(int type, __m512i codes, float scale_value,
                                            float offset_value, void *out, int out_bf16,
                                            int64_t at) {
    const int entries = table_entries(type), base = code_base(type);
    if (!out_bf16 || !entries) {
        store_block_values(codes, scale_value, offset_value, out, out_bf16, at);
        return;
    }
    const __m512 scale = _mm512_set1_ps(scale_value), offset = _mm512_set1_ps(offset_value);
    const __m512 first = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 low = _mm512_fmadd_ps(_mm512_add_ps(first, _mm512_set1_ps((float)base)), scale, offset);
    __m512i table = _mm512_castsi256_si512(round_to_bf16(low));
    if (entries == 32) {
        __m512 high = _mm512_fmadd_ps(_mm512_add_ps(first, _mm512_set1_ps((float)(base + 16))),
                                      scale, offset);
        table = _mm512_inserti64x4(table, round_to_bf16(high), 1);
    }
    __m512i index = base ? _mm512_sub_epi16(codes, _mm512_set1_epi16((short)base)) : codes;
    _mm512_storeu_si512((uint16_t *)out + at, _mm512_permutexvar_epi16(index, table));
}
