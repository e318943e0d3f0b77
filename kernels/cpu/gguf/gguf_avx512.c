/* The AVX-512 vector code of the register kernel (gguf_registers.c, which includes this file
 * and describes the design): a 32-block is one 512-bit vector of int16, one vpmaddwd. */

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

/* ---- per-block factors: weight scale x activation step, and the offset terms -------------- */

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

/* Q4_K/Q5_K: the 8 scales and 8 mins of a super-block as 16 floats [scales, mins]. */
static inline __m512 k4_scales_mins(const uint8_t *packed) {
    uint8_t bytes[16];
    k4_scales_mins_bytes(packed, bytes);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes)));
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

static inline __attribute__((always_inline)) void run_pass(int type, int batch, const Pass *p,
                                                           float out[ROW_GROUP][ROW_BATCH]) {
    const int per = type >= T_Q4_K ? 8 : 1;  /* 32-blocks per stored block */
    const int size = block_bytes(type);
    const int64_t blocks = p->k / 32;
    __m512 acc[ROW_GROUP][ROW_BATCH];
    for (int r = 0; r < ROW_GROUP; r++)
        for (int m = 0; m < batch; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t stored = 0; stored < blocks / per; stored++) {
        prefetch_ahead(p, stored, size);
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

/* 32 int16 codes -> scale * code + offset at out[at..at+32) in float32 or bf16 (decode_row_values
 * in gguf_registers.c says why this gives gguf's values bit for bit). */
static inline void store_block_values(__m512i codes, float scale_value, float offset_value,
                                      void *out, int out_bf16, int64_t at) {
    const __m512 scale = _mm512_set1_ps(scale_value), offset = _mm512_set1_ps(offset_value);
    __m512 low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
        _mm512_castsi512_si256(codes))), scale, offset);
    __m512 high = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
        _mm512_extracti64x4_epi64(codes, 1))), scale, offset);
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
