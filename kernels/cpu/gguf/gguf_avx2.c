/* The AVX2 vector code of the register kernel (gguf_registers.c, which includes this file and
 * describes the design): a 32-block is two 256-bit vectors of int16 (values 0-15 and 16-31),
 * two vpmaddwd. The same decodes as gguf_avx512.c, with compares and blends where that file
 * has mask registers. */

/* Activation steps per 32 values for every type: the K-quants' integer super-block sums
 * (gguf_avx512.c) would overflow eight int32 lanes on Q6_K, and are not built here. */
#define SUPER_SPAN 32

typedef struct {
    __m256i low, high;  /* values 0..15, 16..31 of a 32-block as int16 */
} Block16x2;
typedef Block16x2 DecodedBlock;  /* what decode_block gives */

static inline float sum8_ps(__m256 v) {
    __m128 folded = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    folded = _mm_add_ps(folded, _mm_movehl_ps(folded, folded));
    return _mm_cvtss_f32(_mm_add_ss(folded, _mm_movehdup_ps(folded)));
}

static inline float max8_ps(__m256 v) {
    __m128 folded = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    folded = _mm_max_ps(folded, _mm_movehl_ps(folded, folded));
    return _mm_cvtss_f32(_mm_max_ss(folded, _mm_movehdup_ps(folded)));
}

static inline int32_t sum8_epi32(__m256i v) {
    __m128i folded = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    folded = _mm_add_epi32(folded, _mm_shuffle_epi32(folded, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(folded, _mm_shuffle_epi32(folded, 0xB1)));
}

/* ---- activations ------------------------------------------------------------------------- */

static inline __m256 load8_x(const void *x, int bf16, int64_t index) {
    if (bf16) {  /* bf16 is the top half of a float32 */
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + index);
}

static inline __m256i clamp127(__m256i v) {
    return _mm256_max_epi32(_mm256_min_epi32(v, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
}

/* 8 values -> RESIDUAL q1 + q2 as int32, computed as quantize_row does (round to nearest
 * even, the same order of float operations). */
static inline __m256i two_codes(__m256 values, __m256 d, __m256 inverse) {
    __m256i code = clamp127(_mm256_cvtps_epi32(_mm256_mul_ps(values, inverse)));
    __m256 rest = _mm256_fnmadd_ps(d, _mm256_cvtepi32_ps(code), values);
    rest = _mm256_mul_ps(_mm256_mul_ps(rest, inverse), _mm256_set1_ps((float)RESIDUAL));
    return _mm256_add_epi32(_mm256_mullo_epi32(code, _mm256_set1_epi32(RESIDUAL)),
                            clamp127(_mm256_cvtps_epi32(rest)));
}

/* 16 int32 (each fits int16) -> 16 int16 in order: packs interleaves 128-bit lanes, the
 * permute puts them back. */
static inline __m256i narrow16(__m256i first, __m256i second) {
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(first, second), 0xD8);
}

/* The largest magnitude of x[base .. base + count), count a multiple of 32. */
static float amax_of(const void *x, int bf16, int64_t base, int64_t count) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 top = _mm256_setzero_ps();
    for (int64_t at = 0; at < count; at += 8)
        top = _mm256_max_ps(top, _mm256_and_ps(load8_x(x, bf16, base + at), magnitude));
    return max8_ps(top);
}

/* One row of k values -> RESIDUAL q1 + q2 per value, one step per `span` values and the sum
 * of each 32-block (this library's span is always 32: SUPER_SPAN). */
static void quantize_wide_row(const void *x, int bf16, int64_t base, int64_t k, int span,
                              int16_t *value, float *step, float *sum) {
    for (int64_t group = 0; group < k / span; group++) {
        float amax = amax_of(x, bf16, base + group * span, span);
        float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256 dv = _mm256_set1_ps(d), iv = _mm256_set1_ps(inverse);
        step[group] = d / (float)RESIDUAL;
        for (int64_t block = group * (span / 32); block < (group + 1) * (span / 32); block++) {
            __m256i c[4];
            for (int i = 0; i < 4; i++)
                c[i] = two_codes(load8_x(x, bf16, base + 32 * block + 8 * i), dv, iv);
            _mm256_storeu_si256((__m256i *)(value + 32 * block), narrow16(c[0], c[1]));
            _mm256_storeu_si256((__m256i *)(value + 32 * block + 16), narrow16(c[2], c[3]));
            int32_t total = sum8_epi32(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]),
                                                        _mm256_add_epi32(c[2], c[3])));
            sum[block] = step[group] * (float)total;
        }
    }
}

/* ---- weight blocks -> 32 signed int16 ------------------------------------------------------ */

/* 32 bytes -> 32 int16 */
static inline Block16x2 widen(__m256i bytes) {
    Block16x2 out = {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(bytes)),
                     _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bytes, 1))};
    return out;
}

/* 16 bytes -> their low nibbles (values 0..15), then their high nibbles (values 16..31) */
static inline Block16x2 nibbles16(const uint8_t *qs) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(15);
    Block16x2 out = {_mm256_cvtepu8_epi16(_mm_and_si128(bytes, low)),
                     _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low))};
    return out;
}

/* int16 lane j all ones where bit j of the 16 bits is set */
static inline __m256i bit_lanes(uint32_t bits16) {
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                          4096, 8192, 16384, (short)0x8000);
    return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)bits16), bit), bit);
}

/* Value j gains 16 where bit j of the 32-bit word at qh is set (Q5_1), or loses 16 where it is
 * clear (Q5_0: code - 16). */
static inline Block16x2 fifth_bits16(Block16x2 codes, const uint8_t *qh, int minus_where_clear) {
    uint32_t bits = load_u32(qh);
    if (minus_where_clear) bits = ~bits;
    __m256i sixteen = _mm256_set1_epi16(16);
    __m256i low = _mm256_and_si256(bit_lanes(bits & 0xFFFF), sixteen);
    __m256i high = _mm256_and_si256(bit_lanes(bits >> 16), sixteen);
    if (minus_where_clear) {
        codes.low = _mm256_sub_epi16(codes.low, low);
        codes.high = _mm256_sub_epi16(codes.high, high);
    } else {
        codes.low = _mm256_add_epi16(codes.low, low);
        codes.high = _mm256_add_epi16(codes.high, high);
    }
    return codes;
}

/* Block `index` of a 32-value type, or sub-block `index` (0..7) of a K-quant super-block. */
static inline Block16x2 decode_block(int type, const uint8_t *b, int index) {
    const __m256i low4 = _mm256_set1_epi8(15);
    switch (type) {
    case T_Q8_0: {
        Block16x2 out = {_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2))),
                         _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18)))};
        return out;
    }
    case T_Q4_0: {
        Block16x2 out = nibbles16(b + 2);
        out.low = _mm256_sub_epi16(out.low, _mm256_set1_epi16(8));
        out.high = _mm256_sub_epi16(out.high, _mm256_set1_epi16(8));
        return out;
    }
    case T_Q4_1: return nibbles16(b + 4);
    case T_Q5_0: return fifth_bits16(nibbles16(b + 6), b + 2, 1);
    case T_Q5_1: return fifth_bits16(nibbles16(b + 8), b + 4, 0);
    case T_Q4_K: case T_Q5_K: {  /* 32 bytes per two sub-blocks: low nibbles, high nibbles */
        const uint8_t *qs = b + (type == T_Q5_K ? 48 : 16) + 32 * (index >> 1);
        __m256i bytes = _mm256_loadu_si256((const __m256i *)qs);
        __m256i codes = (index & 1) ? _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4)
                                    : _mm256_and_si256(bytes, low4);
        if (type == T_Q5_K) {  /* bit `index` of qh[l] tops value l */
            __m256i bit = _mm256_set1_epi8((char)(1 << index));
            __m256i top = _mm256_cmpeq_epi8(
                _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(b + 16)), bit), bit);
            codes = _mm256_add_epi8(codes, _mm256_and_si256(top, _mm256_set1_epi8(16)));
        }
        return widen(codes);
    }
    case T_Q6_K: {  /* sub-block 4 h + c: low 4 bits from ql, 2 high bits from qh (unpack_q6_k) */
        int half = index >> 2, quarter = index & 3;
        __m256i low = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (quarter & 1)));
        __m256i high = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
        /* 16-bit shifts: what crosses into the neighbouring byte is masked off below */
        low = quarter < 2 ? _mm256_and_si256(low, low4)
                          : _mm256_and_si256(_mm256_srli_epi16(low, 4), low4);
        /* bits 2c, 2c+1 of qh to bits 4, 5 (index is a constant once the caller is unrolled) */
        high = quarter == 0 ? _mm256_slli_epi16(high, 4) : quarter == 1 ? _mm256_slli_epi16(high, 2)
             : quarter == 2 ? high : _mm256_srli_epi16(high, 2);
        high = _mm256_and_si256(high, _mm256_set1_epi8(0x30));
        Block16x2 out = widen(_mm256_or_si256(low, high));
        /* (code - 32) times the int8 scale of its 16-value half: |.| <= 4096 */
        const int8_t *scales = (const int8_t *)(b + 192);
        out.low = _mm256_mullo_epi16(_mm256_sub_epi16(out.low, _mm256_set1_epi16(32)),
                                     _mm256_set1_epi16(scales[2 * index]));
        out.high = _mm256_mullo_epi16(_mm256_sub_epi16(out.high, _mm256_set1_epi16(32)),
                                      _mm256_set1_epi16(scales[2 * index + 1]));
        return out;
    }
    default: {
        Block16x2 out = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        return out;
    }
    }
}

/* ---- per-block factors: weight scale x activation step, and the offset terms -------------- */

/* K-quants: per super-block, its 8 sub-block scales (d x 6-bit scale; Q6_K: d, its int8
 * scales are in the codes) and offsets (-dmin x 6-bit min). */
static void row_factors(int type, const uint8_t *w, RowFactors *f) {
    __m256 offset_acc[ROW_BATCH];
    for (int m = 0; m < ROW_BATCH; m++) offset_acc[m] = _mm256_setzero_ps();
    int size = block_bytes(type), with_offset = has_offset(type);
    for (int64_t super = 0; type >= T_Q4_K && super < f->blocks / 8; super++) {
        const uint8_t *b = w + super * size;
        __m256 scale, offset = _mm256_setzero_ps();
        if (type == T_Q6_K) {
            scale = _mm256_set1_ps(half_to_float(b + 208));
        } else {
            uint8_t bytes[16];
            k4_scales_mins_bytes(b + 4, bytes);
            scale = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                      _mm_loadl_epi64((const __m128i *)bytes))),
                                  _mm256_set1_ps(half_to_float(b)));
            offset = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                       _mm_loadl_epi64((const __m128i *)(bytes + 8)))),
                                   _mm256_set1_ps(-half_to_float(b + 2)));
        }
        int64_t first = 8 * super;
        for (int m = 0; m < f->batch; m++) {
            __m256 step = _mm256_loadu_ps(f->step + m * f->steps + first);
            _mm256_storeu_ps(f->factor + m * f->blocks + first, _mm256_mul_ps(scale, step));
            if (with_offset)
                offset_acc[m] = _mm256_fmadd_ps(
                    offset, _mm256_loadu_ps(f->sum + m * f->blocks + first), offset_acc[m]);
        }
    }
    for (int m = 0; m < f->batch; m++) f->offset_dot[m] = sum8_ps(offset_acc[m]);
}

/* ---- the pass: ROW_GROUP weight rows x `batch` activation rows --------------------------- */

static inline __attribute__((always_inline)) void run_pass(int type, int batch, const Pass *p,
                                                           float out[ROW_GROUP][ROW_BATCH]) {
    const int per = type >= T_Q4_K ? 8 : 1;  /* 32-blocks per stored block */
    const int size = block_bytes(type);
    const int64_t blocks = p->k / 32;
    __m256 acc[ROW_GROUP][ROW_BATCH];
    for (int r = 0; r < ROW_GROUP; r++)
        for (int m = 0; m < batch; m++) acc[r][m] = _mm256_setzero_ps();
    for (int64_t stored = 0; stored < blocks / per; stored++) {
        prefetch_ahead(p, stored, size);
#pragma GCC unroll 8
        for (int j = 0; j < per; j++) {
            int64_t block = stored * per + j;
            Block16x2 w[ROW_GROUP];
            __m256 scale[ROW_GROUP], min[ROW_GROUP];
            for (int r = 0; r < ROW_GROUP; r++) {
                const uint8_t *b = p->rows[r] + stored * size;
                w[r] = decode_block(type, b, j);
                if (per == 1) {  /* fp16 d; m (Q4_1/Q5_1) in lane 0 only, zeros elsewhere */
                    scale[r] = _mm256_set1_ps(half_to_float(b));
                    if (has_offset(type))
                        min[r] = _mm256_cvtph_ps(_mm_cvtsi32_si128(b[2] | b[3] << 8));
                }
            }
            for (int m = 0; m < batch; m++) {
                const int16_t *v = p->value + m * p->k + 32 * block;
                __m256i low = _mm256_loadu_si256((const __m256i *)v);
                __m256i high = _mm256_loadu_si256((const __m256i *)(v + 16));
                for (int r = 0; r < ROW_GROUP; r++) {
                    /* |w| <= 4096 (Q6_K), |v| <= 32385: four products per lane fit int32 */
                    __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(
                        _mm256_madd_epi16(w[r].low, low), _mm256_madd_epi16(w[r].high, high)));
                    if (per > 1) {  /* the row's factors were computed beforehand */
                        float f = p->factor[(r * batch + m) * blocks + block];
                        acc[r][m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(f), acc[r][m]);
                        continue;
                    }
                    __m256 f = _mm256_mul_ps(scale[r], _mm256_set1_ps(p->step[m * blocks + block]));
                    acc[r][m] = _mm256_fmadd_ps(dot, f, acc[r][m]);
                    if (has_offset(type))  /* m x the block's activation sum, in lane 0 only */
                        acc[r][m] = _mm256_fmadd_ps(
                            min[r], _mm256_set1_ps(p->sum[m * blocks + block]), acc[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < ROW_GROUP; r++)
        for (int m = 0; m < batch; m++) out[r][m] = sum8_ps(acc[r][m]);
}

/* ---- decoded blocks -> float32 or bf16 values ---------------------------------------------- */

/* 8 floats -> 8 bf16, rounded to nearest even as torch does (NaN kept a quiet NaN). */
static inline __m128i round_to_bf16(__m256 values) {
    __m256i bits = _mm256_castps_si256(values);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(values, values, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, quiet, nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

/* 16 int16 codes -> scale * code + offset at out[at..at+16) */
static inline void store_values16(__m256i codes, __m256 scale, __m256 offset, void *out,
                                  int out_bf16, int64_t at) {
    __m256 low = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
        _mm256_castsi256_si128(codes))), scale, offset);
    __m256 high = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
        _mm256_extracti128_si256(codes, 1))), scale, offset);
    if (out_bf16) {
        uint16_t *dst = (uint16_t *)out + at;
        _mm_storeu_si128((__m128i *)dst, round_to_bf16(low));
        _mm_storeu_si128((__m128i *)(dst + 8), round_to_bf16(high));
    } else {
        _mm256_storeu_ps((float *)out + at, low);
        _mm256_storeu_ps((float *)out + at + 8, high);
    }
}

/* 32 int16 codes -> scale * code + offset at out[at..at+32) in float32 or bf16 (decode_run_values
 * in gguf_registers.c says why this gives gguf's values bit for bit). */
static inline void store_block_values(Block16x2 codes, float scale_value, float offset_value,
                                      void *out, int out_bf16, int64_t at) {
    const __m256 scale = _mm256_set1_ps(scale_value), offset = _mm256_set1_ps(offset_value);
    store_values16(codes.low, scale, offset, out, out_bf16, at);
    store_values16(codes.high, scale, offset, out, out_bf16, at + 16);
}

/* A Q8_0 block's values from its codes (gguf_avx512.c's store_q8_0_values skips the int16
 * step, whose widenings cross lanes there; decode_block's two 128-bit halves cost nothing
 * extra here). */
static inline void store_q8_0_values(const uint8_t *codes, float scale_value, void *out,
                                     int out_bf16, int64_t at) {
    store_block_values(decode_block(T_Q8_0, codes - 2, 0), scale_value, 0.0f, out, out_bf16, at);
}

/* A Q6_K super-block for its stores: nothing to prepare ahead here (the AVX-512 library builds
 * its codes as bytes one block ahead). */
typedef struct {
    const uint8_t *b;
} Q6kReady;

static inline void q6_k_prepare(const uint8_t *b, Q6kReady *q) { q->b = b; }

/* A Q6_K super-block's 256 values: each sub-block's codes, already times their int8 scales in
 * decode_block, times d. */
static inline void store_q6_k_values(const Q6kReady *q, void *out, int out_bf16, int64_t at) {
    const uint8_t *b = q->b;
    const float d = half_to_float(b + 208);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
        store_block_values(decode_block(T_Q6_K, b, j), d, 0.0f, out, out_bf16, at + 32 * j);
}

static inline void store_block_values_typed(int type, Block16x2 codes, float scale_value,
                                            float offset_value, void *out, int out_bf16,
                                            int64_t at) {
    (void)type;  /* no word permute across 256-bit lanes in AVX2: every code converted */
    store_block_values(codes, scale_value, offset_value, out, out_bf16, at);
}
