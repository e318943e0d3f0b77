/* Small x86 helpers shared by the C kernels: the AMX tile configuration they all use and a
 * vectorised exp, each present where the build has the instructions it needs. */
#ifndef PAGEDGEN_CPU_X86_COMMON_H
#define PAGEDGEN_CPU_X86_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__)
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Every kernel here uses full tiles: all 8 as 16 rows x 64 bytes (palette 1). Per thread,
 * before its first tile instruction; _tile_release() when done. */
static inline void configure_full_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}
#endif

#if defined(__AVX512F__)
/* exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2,
 * p the degree-6 Taylor polynomial (relative error ~1e-7). Written out because libm's scalar
 * expf, which the compiler called for most of the lanes, cost more than the dot products. */
static inline __attribute__((always_inline)) __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f)); /* below: 0 after scaling anyway */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln2, split in two */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Lane t of the result = sum of the 16 lanes of v[t]. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: [a, b, c, d] lane partial sums */
        __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The lanes of the 16 keys from `from` on that lie before `first` (before a sliding window). */
static inline __attribute__((always_inline)) __mmask16 keys_before(int64_t from, int64_t first) {
    const int64_t n = first - from;
    return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

/* sum16 on int32 lanes (exact): lane t of the result = sum of the 16 lanes of v[t]. */
static inline __attribute__((always_inline)) __m512i sum16_epi32(const __m512i v[16]) {
    __m512i pairs[8], quads[4];
    for (int i = 0; i < 8; i++)
        pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                    _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        quads[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * i], pairs[2 * i + 1]),
                                    _mm512_unpackhi_epi64(pairs[2 * i], pairs[2 * i + 1]));
    __m512i lo = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_i32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512i hi = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_i32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#endif
