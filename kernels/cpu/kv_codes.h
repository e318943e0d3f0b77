/* 8-bit KV codes (kernels/kv_quant.py) to floats in registers, shared by the kernels that read
 * a quantized pool in place (decode_attention_q8.c, prefill_attention_avx512.c).
 * Codes: 1 = int8, 2 = fp8 e4m3, 3 = fp8 e5m2; value = code * the block's scale. */
#ifndef PAGEDGEN_CPU_KV_CODES_H
#define PAGEDGEN_CPU_KV_CODES_H

#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>

#define PAGEDGEN_HAVE_KV_CODES 1

/* 16 codes -> 16 floats, exact: int8 by sign extension and conversion; e5m2 is the high byte
 * of a float16 (shift, then VCVTPH2PS); e4m3 becomes 1/256 of its value (code_factor gives the
 * 256 back, to be folded into the block's scale). VCVTPH2PS does not flush subnormal codes. */
static inline __attribute__((always_inline)) __m512 decode16(const uint8_t *src, int codes) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)src);
    if (codes == 1) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    if (codes == 3) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
    /* Sign-extended, shifted by 7: exponent and mantissa in bits 7..13, the sign in 14 and 15;
     * clearing bit 14 leaves the float16 of value / 256. */
    __m256i wide = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(wide, _mm256_set1_epi16((short)0xBFFF)));
}

/* What decode16's floats are to be multiplied by, besides the block's scale. */
static inline float code_factor(int codes) { return codes == 2 ? 256.0f : 1.0f; }

#else
#define PAGEDGEN_HAVE_KV_CODES 0
#endif

#endif
