/* The quantizing store of an 8-bit KV pool for decode steps: one new token per touched block
 * (the caller checks), the same arithmetic as kernels/kv_quant.py's torch path.
 *
 * Why C: the torch path (gather the touched blocks, dequantize, insert, re-quantize, scatter)
 * is some twenty small tensor ops per K and V, per layer, per step; at decode sizes their fixed
 * costs dominate. Here each token touches its own block only: per KV head the new scale is
 * max(old, |row| max / qmax) (old = 0 at a block's offset 0: a new owner), the block's other
 * rows are re-quantized only when the scale grew (a write at offset 0 zeroes them, as the torch
 * path does), and the new row is quantized. Rounding: int8 to nearest even; fp8 to nearest
 * even on the float32 bits (normal range) or on multiples of the subnormal step.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "team_ops.h"

typedef struct {
    float qmax;
    int mant_bits, bias; /* fp8 fields; int8: mant_bits 0 */
} Format;

static Format format_of(int kv_codes) {
    if (kv_codes == 2) return (Format){448.0f, 3, 7};
    if (kv_codes == 3) return (Format){57344.0f, 2, 15};
    return (Format){127.0f, 0, 0};
}

static float pow2i(int n) {
    uint32_t bits = (uint32_t)(n + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float decode(uint8_t c, const Format *f) {
    if (!f->mant_bits) return (float)(int8_t)c;
    int e = (c & 0x7F) >> f->mant_bits, m = c & ((1 << f->mant_bits) - 1);
    float mag = (float)(e ? (1 << f->mant_bits) + m : m) * pow2i((e ? e : 1) - f->bias - f->mant_bits);
    return (c & 0x80) ? -mag : mag;
}

/* x already divided by the scale; clamped here to +-qmax. */
static uint8_t encode(float x, const Format *f) {
    x = x > f->qmax ? f->qmax : (x < -f->qmax ? -f->qmax : x);
    if (!f->mant_bits) return (uint8_t)(int8_t)rintf(x);
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    float a = fabsf(x);
    if (a < pow2i(1 - f->bias)) /* subnormal: a multiple of 2^(1 - bias - M); 2^M is the smallest normal */
        return sign | (uint8_t)rintf(a * pow2i(f->bias - 1 + f->mant_bits));
    uint32_t ab = bits & 0x7FFFFFFFu;
    const int drop = 23 - f->mant_bits;
    ab += ((1u << (drop - 1)) - 1) + ((ab >> drop) & 1u);
    uint32_t e = (ab >> 23) - 127 + f->bias, m = (ab >> drop) & ((1u << f->mant_bits) - 1);
    return sign | (uint8_t)((e << f->mant_bits) | m);
}

static float load_value(const void *row, int64_t d, int is_bf16) {
    if (!is_bf16) return ((const float *)row)[d];
    uint32_t bits = (uint32_t)((const uint16_t *)row)[d] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One token's row of one KV head into its block (codes [B, H, D] of that block). */
static void store_head(const void *src, int is_bf16, uint8_t *block_codes, float *scale, int64_t off,
                       int64_t h, int64_t heads, int64_t dim, int64_t block_size, const Format *f) {
    float top = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        float a = fabsf(load_value(src, d, is_bf16));
        top = a > top ? a : top;
    }
    const float old = off == 0 ? 0.0f : *scale;
    float now = top / f->qmax > old ? top / f->qmax : old;
    now = now < 1e-30f ? 1e-30f : now;
    if (now != old || off == 0) /* off == 0: old is 0, the other rows become 0 */
        for (int64_t r = 0; r < block_size; r++) {
            if (r == off) continue;
            uint8_t *row = block_codes + (r * heads + h) * dim;
            for (int64_t d = 0; d < dim; d++) row[d] = encode(decode(row[d], f) * old / now, f);
        }
    uint8_t *row = block_codes + (off * heads + h) * dim;
    for (int64_t d = 0; d < dim; d++) row[d] = encode(load_value(src, d, is_bf16) / now, f);
    *scale = now;
}

/* This thread's share of the rows (each row in a block of its own: the caller checks, so no two
 * threads touch one block), ending in a barrier; outside a region, every row. */
void store_kv_q8_team(const void *key, int64_t key_stride_bytes, const void *value,
                      int64_t value_stride_bytes, int is_bf16, void *k_cache, void *v_cache,
                      float *k_scales, float *v_scales, const int64_t *slots, int64_t rows,
                      int64_t heads, int64_t dim, int64_t block_size, int kv_codes) {
    const Format f = format_of(kv_codes);
    const int64_t elem = is_bf16 ? 2 : 4, block_bytes = block_size * heads * dim;
    const int me = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t first = rows * me / threads, last = rows * (me + 1) / threads;
    for (int64_t t = first; t < last; t++) {
        if (slots[t] < 0) continue;
        const int64_t block = slots[t] / block_size, off = slots[t] % block_size;
        for (int64_t h = 0; h < heads; h++) {
            store_head((const char *)key + t * key_stride_bytes + h * dim * elem, is_bf16,
                       (uint8_t *)k_cache + block * block_bytes, k_scales + block * heads + h, off,
                       h, heads, dim, block_size, &f);
            store_head((const char *)value + t * value_stride_bytes + h * dim * elem, is_bf16,
                       (uint8_t *)v_cache + block * block_bytes, v_scales + block * heads + h, off,
                       h, heads, dim, block_size, &f);
        }
    }
#pragma omp barrier
}

/* The Python entry point, on the calling thread. Returns 1, writing nothing, when a slot is
 * past the cache. */
int store_kv_q8(const void *key, int64_t key_stride_bytes, const void *value,
                int64_t value_stride_bytes, int is_bf16, void *k_cache, void *v_cache,
                float *k_scales, float *v_scales, const int64_t *slots, int64_t rows,
                int64_t heads, int64_t dim, int64_t block_size, int64_t capacity, int kv_codes) {
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] >= capacity) return 1;
    store_kv_q8_team(key, key_stride_bytes, value, value_stride_bytes, is_bf16, k_cache, v_cache,
                     k_scales, v_scales, slots, rows, heads, dim, block_size, kv_codes);
    return 0;
}
