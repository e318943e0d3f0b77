/* What the skinny bfloat16 GEMMs share (gemm_amx.c on the tile unit, gemm_avx512.c with
 * VDPBF16PS, gemm_avx2.c with float32 FMAs): the packed weight layout and the rounding of the
 * float32 sums.
 *
 * Packed layout (amx_pack_weight, always compiled): for each block of 16 output columns, the
 * input pairs in order, each pair as 16 columns x (W[n][2 p], W[n][2 p + 1]): 64 bytes, which
 * is one row of an AMX weight tile and one zmm operand of VDPBF16PS alike. 16 pairs (32
 * inputs) make one 1 KB tile; a column block's pairs are contiguous (its "panel").
 */
#ifndef PAGEDGEN_CPU_GEMM_COMMON_H
#define PAGEDGEN_CPU_GEMM_COMMON_H

#include <stdint.h>

#define GEMM_TILE_ELEMS 512 /* 16 pairs x 16 columns x 2 bf16: one packed weight tile */
#define GEMM_PAIR_ELEMS 32  /* one input pair of a 16-column block */

/* w: [n, k] bf16 -> out (n * k elements) in the layout above; 1 (nothing written) unless
 * n % 16 == 0 and k % 32 == 0. */
int amx_pack_weight(const uint16_t *w, int64_t n, int64_t k, uint16_t *out);

/* The [m, n] output: bf16, or float32 holding the same bf16-rounded values (the LM head's
 * logits, which the sampler wants in float32: one pass over them less). stream: float32 rows
 * written with non-temporal stores (64-byte aligned data only): an LM head's logits over a
 * large vocabulary are far larger than the caches and read once, later, by the sampler, so
 * reading each line before writing it (and evicting the weights) only costs bandwidth. */
typedef struct {
    void *data;
    int64_t n;
    int f32;
    int stream;
    int prefetch; /* 1: each row tile write-prefetches the next one's lines (gemm_avx512.c) */
} GemmOut;

/* Float32 outputs at least this large are streamed (see GemmOut.stream). */
#define GEMM_STREAM_MIN_BYTES (8 << 20)

static inline int gemm_streams(const void *out, int64_t m, int64_t n, int out_f32) {
    return out_f32 && m * n * 4 >= GEMM_STREAM_MIN_BYTES && ((uintptr_t)out & 63) == 0;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* A tile is a 16 x 16 transpose of 32-bit words (row col's pair k2 -> tile row k2, slot col):
 * four stages of in-register shuffles. Packing then runs at memory speed, which matters
 * where a weight is packed per call (a GGUF weight dequantized for a large-row call). */
static inline void gemm_pack_tile(const uint16_t *w, int64_t k, uint16_t *tile) {
    __m512i a[16], b[16];
    for (int col = 0; col < 16; col++) a[col] = _mm512_loadu_si512(w + col * k);
    for (int i = 0; i < 16; i += 2) { /* words of rows i, i + 1 interleaved */
        b[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
        b[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int j = 0; j < 2; j++) { /* pairs of rows i..i + 3 */
            a[i + j] = _mm512_unpacklo_epi64(b[i + j], b[i + j + 2]);
            a[i + j + 2] = _mm512_unpackhi_epi64(b[i + j], b[i + j + 2]);
        }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) { /* 128-bit lanes of rows i..i + 7 */
            b[i + j] = _mm512_shuffle_i32x4(a[i + j], a[i + j + 4], _MM_SHUFFLE(2, 0, 2, 0));
            b[i + j + 4] = _mm512_shuffle_i32x4(a[i + j], a[i + j + 4], _MM_SHUFFLE(3, 1, 3, 1));
        }
    for (int j = 0; j < 8; j++) {
        a[j] = _mm512_shuffle_i32x4(b[j], b[j + 8], _MM_SHUFFLE(2, 0, 2, 0));
        a[j + 8] = _mm512_shuffle_i32x4(b[j], b[j + 8], _MM_SHUFFLE(3, 1, 3, 1));
    }
    /* a[j] holds tile row row_of[j]: the unpacks leave rows 1 and 2 of each four swapped */
    static const int row_of[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
    for (int j = 0; j < 16; j++) _mm512_storeu_si512(tile + row_of[j] * 32, a[j]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)

/* 16 float32 sums (+ bias, added in float32 before the one rounding, as oneDNN does) -> bf16
 * rounded to nearest even, into row `row`, columns col..col+15 of out. */
static inline __attribute__((always_inline)) void gemm_store16(__m512 sums, const uint16_t *bias,
                                                               GemmOut out, int64_t row,
                                                               int64_t col) {
    if (bias) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias));
        sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
    __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sums);
    if (out.stream) /* n % 16 == 0 and col % 16 == 0: every row start stays 64-byte aligned */
        _mm512_stream_si512((__m512i *)((float *)out.data + row * out.n + col),
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    else if (out.f32)
        _mm512_storeu_si512((float *)out.data + row * out.n + col,
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)out.data + row * out.n + col), rounded);
}
#endif

#endif
