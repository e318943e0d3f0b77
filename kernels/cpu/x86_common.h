/* Small x86 helpers shared by the C kernels: the AMX tile configuration they all use, bf16
 * widening and rounding and a vectorised exp, each present where the build has the
 * instructions it needs. */
#ifndef PAGEDGEN_CPU_X86_COMMON_H
#define PAGEDGEN_CPU_X86_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

/* Linux grants the 8 KB AMX tile state per process, on request (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA): 1 granted. Asked once per library, first outside parallel regions
 * (every library asks when it is loaded). Compiled without AMX flags, so that a library of a
 * narrower path can tell whether the AMX one may run. */
static inline int amx_tile_state_granted(void) {
    static int state = 0; /* 0 unknown, 1 yes, -1 no */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state == 1;
}
#else
static inline int amx_tile_state_granted(void) { return 0; }
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

/* p = the degree-6 Taylor polynomial of 2^r = e^(r ln2), by Horner, in any vector width (set1
 * and fmadd of that width): one list of coefficients for the AVX2 and AVX-512 forms of 2^x. */
#define EXP2_TAYLOR6(p, r, set1, fmadd)                                                       \
    do {                                                                                      \
        p = set1(1.5403530393381606e-4f);              /* ln2^6 / 720 */                      \
        p = fmadd(p, r, set1(1.3333558146428443e-3f)); /* ln2^5 / 120 */                      \
        p = fmadd(p, r, set1(9.6181291076284772e-3f)); /* ln2^4 / 24 */                       \
        p = fmadd(p, r, set1(5.5504108664821580e-2f)); /* ln2^3 / 6 */                        \
        p = fmadd(p, r, set1(2.4022650695910071e-1f)); /* ln2^2 / 2 */                        \
        p = fmadd(p, r, set1(6.9314718055994531e-1f)); /* ln2 */                              \
        p = fmadd(p, r, set1(1.0f));                                                          \
    } while (0)

#if defined(__AVX2__) && defined(__FMA__)
/* The AVX2 forms (CPUs without AVX-512): 8 float32 lanes. A 32-bit lane of bf16 data holds a
 * pair; a shift gives its first (even) value as float32, a mask its second (odd) one. */
static inline __attribute__((always_inline)) __m256 bf16_pairs_even8(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}
static inline __attribute__((always_inline)) __m256 bf16_pairs_odd8(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 8 bf16 values -> 8 float32. */
static inline __attribute__((always_inline)) __m256 bf16x8_to_f32(const uint16_t *src) {
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

/* 8 float32 values rounded to bf16, nearest even (NaN stays NaN), in each word's upper half:
 * torch's rounding, so that a float32 output is exactly the bf16 output widened. */
static inline __attribute__((always_inline)) __m256i bf16x8_round(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
    return _mm256_and_si256(rounded, _mm256_set1_epi32((int)0xFFFF0000u));
}

/* Two bf16x8_round results (values 0-7 and 8-15) stored as 16 bf16 values. */
static inline __attribute__((always_inline)) void bf16x16_store_rounded(uint16_t *dst, __m256i lo,
                                                                       __m256i hi) {
    /* packus works per 128-bit lane: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> lanes reordered */
    const __m256i packed =
        _mm256_packus_epi32(_mm256_srli_epi32(lo, 16), _mm256_srli_epi32(hi, 16));
    _mm256_storeu_si256((__m256i *)dst, _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}

/* 2^x for x <= 0, as exp2_nonpositive below. Lanes with larger x come out as garbage bits (the
 * exponent field overflows): callers mask them away bitwise. */
static inline __attribute__((always_inline)) __m256 exp2_8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f)); /* 2^n stays a normal float */
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(x, n);
    __m256 p;
    EXP2_TAYLOR6(p, r, _mm256_set1_ps, _mm256_fmadd_ps);
    const __m256i two_n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

#if defined(__AVX512F__)
/* bf16 is the upper half of a float32: widening is exact, a shift or a mask. */

/* 16 bf16 values in a register -> 16 float32. */
static inline __attribute__((always_inline)) __m512 bf16x16_widen(__m256i words) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

/* 16 bf16 values -> 16 float32. */
static inline __attribute__((always_inline)) __m512 bf16x16_to_f32(const uint16_t *src) {
    return bf16x16_widen(_mm256_loadu_si256((const __m256i *)src));
}

/* 16 pairs of bf16 (one per 32-bit lane) -> the 16 first (even) values as float32 ... */
static inline __attribute__((always_inline)) __m512 bf16_pairs_even(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}

/* ... and the 16 second (odd) ones. */
static inline __attribute__((always_inline)) __m512 bf16_pairs_odd(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000)));
}

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

/* 2^x for x <= 0: 2^n * p(r) with x = n + r, |r| <= 1/2 (exact), p the degree-6 Taylor
 * polynomial of e^(r ln2) (relative error ~1e-7). With the scale and log2(e) folded into one
 * FMA before it, four instructions fewer than exp_nonpositive per vector; no clamp needed:
 * r stays within 1/2 whatever x is, and 2^n underflows to 0. */
static inline __attribute__((always_inline)) __m512 exp2_nonpositive(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p;
    EXP2_TAYLOR6(p, r, _mm512_set1_ps, _mm512_fmadd_ps);
    return _mm512_scalef_ps(p, n);
}

/* Whether float32 FMAs on bf16 values widened to float32 multiply faster than VDPBF16PS on
 * this CPU. VDPBF16PS does 32 multiply-adds, a 512-bit FMA 16, but not at the same rate
 * everywhere: on AMD Zen 4 they issue alike (VDPBF16PS twice the work), on Intel Xeons of the
 * Sapphire/Emerald Rapids generation a VDPBF16PS issues once per two cycles and FMAs twice per
 * cycle (the FMA twice the work). Vendors and models do not say it, so it is timed: each
 * instruction in 16 independent chains, the best of 5 short runs, and the FMA form chosen
 * only where it does at least 1.3x VDPBF16PS's multiply-adds per cycle (the two kinds
 * measured here are 2x apart either way, so the choice does not flip with a busy machine). */
#if defined(__AVX512BF16__)
static inline uint64_t time_chains(int fma) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_ps((float)i * 1e-9f);
    __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(1);
    const uint64_t start = __rdtsc();
    for (int n = 0; n < 512; n++) {
        if (fma) {
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
            __asm__ volatile("" : "+v"(a));
        } else {
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
            __asm__ volatile("" : "+v"(x));
        }
    }
    const uint64_t ticks = __rdtsc() - start;
    for (int i = 0; i < 16; i++) __asm__ volatile("" : : "v"(acc[i]));
    return ticks;
}

static inline int float32_fma_multiplies_faster(void) {
    uint64_t best_fma = UINT64_MAX, best_dot = UINT64_MAX;
    for (int run = 0; run < 5; run++) {
        const uint64_t fma = time_chains(1), dot = time_chains(0);
        if (fma < best_fma) best_fma = fma;
        if (dot < best_dot) best_dot = dot;
    }
    /* multiply-adds per tick: 16 / best_fma against 32 / best_dot */
    return 16.0 * (double)best_dot >= 1.3 * 32.0 * (double)best_fma;
}

/* A kernel family's form setting (*slot: -1 until first chosen): form 0 (VDPBF16PS) or 1
 * (float32 FMA) sets it, -1 times this CPU again and takes the faster, -2 only asks (timing
 * at the first ask); returns the form in effect. */
static inline int choose_form(int *slot, int form) {
    if (form == -2) form = __atomic_load_n(slot, __ATOMIC_RELAXED);
    if (form < 0) form = float32_fma_multiplies_faster();
    __atomic_store_n(slot, form, __ATOMIC_RELAXED);
    return form;
}
#endif

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
