/* Fused elementwise ops of the decoder for bfloat16 on the CPU (built with
 * cpu_decode_attention.c into one library by kernels/native.py).
 *
 * Why: in torch, the residual add + RMSNorm is nine ops and SiLU(gate) * up two, each a
 * separate pass over memory with its own dispatch; at decode batch sizes the dispatch
 * dominates and at prefill sizes the passes do. One pass each here, rounding to bfloat16 at
 * the same points torch does (so results match torch's to the last bit or one ulp).
 * Threads: OpenMP over rows, on torch's own runtime (see cpu_decode_attention.c). Each op is
 * a `*_team` loop (an orphaned `omp for`: run by whichever team calls it, barrier at the end)
 * and an entry point that opens a parallel region around it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_team_ops.h"

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

/* residual += delta (when delta != NULL), then out = bf16(bf16(residual * rsqrt(mean(residual^2)
 * + eps)) * weight): transformers' LlamaRMSNorm order (normalise in float32, cast, scale). */
void add_rms_norm_team(uint16_t *residual, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t dim, float eps) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *x = residual + r * dim;
        if (delta) {
            const uint16_t *d = delta + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) x[i] = bf16_round(bf16_load(x[i]) + bf16_load(d[i]));
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) {
            float v = bf16_load(x[i]);
            sum += v * v;
        }
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
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
 * cpu_decode_step.c calls inside its own region). */
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

int rope_bf16(const uint16_t *x, int64_t row_stride, const uint16_t *cos_sin, uint16_t *out,
              int64_t tokens, int64_t heads, int64_t head_dim, int num_threads) {
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    rope_team(x, row_stride, cos_sin, out, tokens, heads, head_dim);
    return 0;
}
