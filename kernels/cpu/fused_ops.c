/* Fused elementwise ops of the decoder for bfloat16 on the CPU (built with
 * decode_attention.c into one library by kernels/cpu/native.py).
 *
 * Why: in torch, the residual add + RMSNorm is nine ops and SiLU(gate) * up two, each a
 * separate pass over memory with its own dispatch; at decode batch sizes the dispatch
 * dominates and at prefill sizes the passes do. One pass each here, rounding to bfloat16 at
 * the same points torch does (so results match torch's to the last bit or one ulp).
 * Threads: OpenMP over rows, on torch's own runtime (see decode_attention.c). Each op is
 * a `*_team` loop (an orphaned `omp for`: run by whichever team calls it, barrier at the end)
 * and an entry point that opens a parallel region around it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "team_ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_load(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One row: x += d (bf16 rounded, as torch's add_) when d != NULL, then rsqrt(mean(x^2) + eps)
 * in float32: the part both RMSNorm styles share. */
static inline float add_then_inv_rms(uint16_t *x, const uint16_t *d, int64_t dim, float eps) {
    if (d) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) x[i] = bf16_round(bf16_load(x[i]) + bf16_load(d[i]));
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; i++) {
        float v = bf16_load(x[i]);
        sum += v * v;
    }
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

/* residual += delta (when delta != NULL), then out = bf16(bf16(residual * rsqrt(mean(residual^2)
 * + eps)) * weight): transformers' LlamaRMSNorm order (normalise in float32, cast, scale). */
void add_rms_norm_team(uint16_t *residual, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t dim, float eps) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *x = residual + r * dim;
        const float inv = add_then_inv_rms(x, delta ? delta + r * dim : NULL, dim, eps);
        uint16_t *o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) {
            float normed = bf16_load(bf16_round(bf16_load(x[i]) * inv));
            o[i] = bf16_round(normed * bf16_load(weight[i]));
        }
    }
}

/* out[r] = bf16(bf16(silu(gate)) * up) with gate_up[r] = [gate | up], each `inter` wide. */
void silu_mul_team(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
        uint16_t *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            float g = bf16_load(gate[i]);
            float silu = bf16_load(bf16_round(g / (1.0f + expf(-g))));
            o[i] = bf16_round(silu * bf16_load(up[i]));
        }
    }
}

/* Gemma's RMSNorm, transformers' Gemma3RMSNorm order: everything in float32, one rounding at
 * the end: out = bf16((x * rsqrt(mean(x^2) + eps)) * (1 + weight)), the weight stored centred
 * on 0. Rows are `dim` wide, `inner` rows `dim` apart make an outer row, outer rows are
 * `outer_stride` apart (q/k heads inside the fused QKV output); out is contiguous. Inner row
 * i is scaled by the weight row at i * weight_stride (0: one weight for all; Gemma's q and
 * k norms differ, stacked one row per head).
 * residual += delta first (bf16 rounded, as torch's add_) when delta != NULL: then rows must
 * be contiguous (inner = 1, outer_stride = dim), as the residual stream is. */
void add_offset_rms_norm_team(uint16_t *residual, int64_t outer_stride, const uint16_t *delta,
                              const uint16_t *weight, int64_t weight_stride, uint16_t *out,
                              int64_t outer, int64_t inner, int64_t dim, float eps) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < outer * inner; r++) {
        uint16_t *x = residual + (r / inner) * outer_stride + (r % inner) * dim;
        const float inv = add_then_inv_rms(x, delta ? delta + r * dim : NULL, dim, eps);
        uint16_t *o = out + r * dim;
        const uint16_t *w = weight + (r % inner) * weight_stride;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = bf16_round((bf16_load(x[i]) * inv) * (1.0f + bf16_load(w[i])));
    }
}

/* out[r] = bf16(bf16(gelu_tanh(gate)) * up) with gate_up[r] = [gate | up]: Gemma's GeGLU,
 * torch's gelu(approximate="tanh") then mul_. 0.5 g (1 + tanh(y)) is computed as
 * g / (1 + exp(-2y)), the same function without tanh (which may not vectorise) and without
 * the cancellation of 1 + tanh(y) for negative y; where tanh(y) is +-1 in float the result
 * is torch's (0 or g), and exp never overflows (-ffast-math assumes it does not). */
void gelu_tanh_mul_team(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f; /* sqrt(2/pi), as torch */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
        uint16_t *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            float g = bf16_load(gate[i]);
            float y = k0 * (g + k1 * g * g * g);
            /* Below -9.0109, tanh(y) is -1 in float: torch's result is exactly 0 there. */
            float sigmoid = y < -9.0109f ? 0.0f : 1.0f / (1.0f + expf(-2.0f * (y > 20.0f ? 20.0f : y)));
            float gelu = bf16_load(bf16_round(g * sigmoid));
            o[i] = bf16_round(gelu * bf16_load(up[i]));
        }
    }
}

/* The index of each row's largest value, the first one on ties, or of its first NaN (torch's
 * max(dim).indices). Integer compares on an order-preserving map of the float bits: no
 * float compare that -ffast-math could reorder, and NaN found by its bits. */
static inline int32_t float_order(uint32_t u) { /* monotone in the float's value */
    if (u == 0x80000000u) u = 0; /* -0 ties with +0, as the float compare has it */
    return (int32_t)(u & 0x80000000u ? u ^ 0x7fffffffu : u);
}

static inline int is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

#if defined(__AVX512F__)
/* Per lane: the largest key so far and where it first occurs, and the lane's first NaN. */
typedef struct {
    __m512i best, best_at, nan_at;
} ArgmaxLanes;

/* float_order and is_nan_bits of 16 values (the `valid` ones) at indices `at`. */
static inline void argmax_step(ArgmaxLanes *lanes, __m512i bits, __m512i at, __mmask16 valid) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    __m512i key = _mm512_xor_si512(bits, _mm512_and_si512(_mm512_srai_epi32(bits, 31), magnitude));
    key = _mm512_mask_mov_epi32(key, _mm512_cmpeq_epi32_mask(bits, _mm512_set1_epi32(INT32_MIN)),
                                _mm512_setzero_si512()); /* -0 takes +0's key */
    const __mmask16 greater = _mm512_mask_cmpgt_epi32_mask(valid, key, lanes->best);
    lanes->best = _mm512_mask_mov_epi32(lanes->best, greater, key);
    lanes->best_at = _mm512_mask_mov_epi32(lanes->best_at, greater, at);
    const __mmask16 nan = _mm512_mask_cmpgt_epi32_mask(
        valid, _mm512_and_si512(bits, magnitude), _mm512_set1_epi32(0x7f800000));
    lanes->nan_at = _mm512_mask_min_epi32(lanes->nan_at, nan, lanes->nan_at, at);
}

/* One pass with four sets of lanes (each set's compare waits on its own previous maximum:
 * four chains keep up with the loads), then the lanes agree on the first index. The portable
 * loop's two passes, the second a scalar scan, ran at a few values per cycle: slower than the
 * logits can be read, a visible share of a decode step over a 262k vocabulary. */
static int64_t argmax_row(const uint32_t *row, int64_t cols) {
    ArgmaxLanes lanes[4];
    for (int s = 0; s < 4; s++)
        lanes[s] = (ArgmaxLanes){_mm512_set1_epi32(INT32_MIN), _mm512_setzero_si512(),
                                 _mm512_set1_epi32(INT32_MAX)};
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t i = 0;
    for (; i + 64 <= cols; i += 64)
        for (int s = 0; s < 4; s++)
            argmax_step(&lanes[s], _mm512_loadu_si512(row + i + 16 * s),
                        _mm512_add_epi32(first, _mm512_set1_epi32((int)(i + 16 * s))), 0xffff);
    for (; i < cols; i += 16) {
        const __mmask16 valid = cols - i >= 16 ? 0xffff : (__mmask16)((1u << (cols - i)) - 1u);
        argmax_step(&lanes[0], _mm512_maskz_loadu_epi32(valid, row + i),
                    _mm512_add_epi32(first, _mm512_set1_epi32((int)i)), valid);
    }
    __m512i best = lanes[0].best, nan_at = lanes[0].nan_at;
    for (int s = 1; s < 4; s++) {
        best = _mm512_max_epi32(best, lanes[s].best);
        nan_at = _mm512_min_epi32(nan_at, lanes[s].nan_at);
    }
    const int32_t first_nan = _mm512_reduce_min_epi32(nan_at);
    if (first_nan != INT32_MAX) return first_nan;
    const __m512i top = _mm512_set1_epi32(_mm512_reduce_max_epi32(best));
    __m512i at = _mm512_set1_epi32(INT32_MAX); /* per lane, the first index holding the top */
    for (int s = 0; s < 4; s++)
        at = _mm512_mask_min_epi32(at, _mm512_cmpeq_epi32_mask(lanes[s].best, top), at,
                                   lanes[s].best_at);
    return _mm512_reduce_min_epi32(at);
}
#else
static int64_t argmax_row(const uint32_t *row, int64_t cols) {
    int32_t best = INT32_MIN;
    uint32_t nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t i = 0; i < cols; i++) {
        const int32_t key = float_order(row[i]);
        best = key > best ? key : best;
        nan |= is_nan_bits(row[i]);
    }
    for (int64_t i = 0; i < cols; i++)
        if (nan ? is_nan_bits(row[i]) : float_order(row[i]) == best) return i;
    return 0;
}
#endif

void argmax_rows_team(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row((const uint32_t *)(x + r * cols), cols);
}

/* Rotary embedding, HF "rotate half" layout: for each head, with x = [x1 | x2],
 * out = [x1*cos - x2*sin | x2*cos + x1*sin], every product and sum rounded to bf16 as torch's
 * bf16 ops do (bit-identical to pagedgen.model.layers.rope.apply_rope). x rows are `row_stride`
 * elements apart (a view into the fused QKV output); cos_sin is [T, 2, D/2]; out is
 * contiguous [T, heads, D]. */
void rope_team(const uint16_t *x, int64_t row_stride, const uint16_t *cos_sin, uint16_t *out,
               int64_t tokens, int64_t heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *cos = cos_sin + t * 2 * half, *sin = cos + half;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *x1 = x + t * row_stride + h * head_dim, *x2 = x1 + half;
            uint16_t *o1 = out + (t * heads + h) * head_dim, *o2 = o1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float c = bf16_load(cos[i]), s = bf16_load(sin[i]);
                float a = bf16_load(x1[i]), b = bf16_load(x2[i]);
                o1[i] = bf16_round(bf16_load(bf16_round(a * c)) - bf16_load(bf16_round(b * s)));
                o2[i] = bf16_round(bf16_load(bf16_round(b * c)) + bf16_load(bf16_round(a * s)));
            }
        }
    }
}

/* The entry points called from Python: one parallel region each around the team loops (which
 * decode_step.c calls inside its own region). */
int add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, const uint16_t *weight,
                      uint16_t *out, int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    add_rms_norm_team(residual, delta, weight, out, rows, dim, eps);
    return 0;
}

int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                  int num_threads) {
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    silu_mul_team(gate_up, out, rows, inter);
    return 0;
}

int add_offset_rms_norm_bf16(uint16_t *residual, int64_t outer_stride, const uint16_t *delta,
                             const uint16_t *weight, int64_t weight_stride, uint16_t *out,
                             int64_t outer, int64_t inner, int64_t dim, float eps,
                             int num_threads) {
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    add_offset_rms_norm_team(residual, outer_stride, delta, weight, weight_stride, out, outer,
                             inner, dim, eps);
    return 0;
}

int gelu_tanh_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                       int num_threads) {
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    gelu_tanh_mul_team(gate_up, out, rows, inter);
    return 0;
}

int argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads) {
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    argmax_rows_team(x, rows, cols, out);
    return 0;
}

int rope_bf16(const uint16_t *x, int64_t row_stride, const uint16_t *cos_sin, uint16_t *out,
              int64_t tokens, int64_t heads, int64_t head_dim, int num_threads) {
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    rope_team(x, row_stride, cos_sin, out, tokens, heads, head_dim);
    return 0;
}
