/* The decoder layers of a pure decode step (one new token per sequence) for bfloat16 on CPUs
 * with AMX or AVX-512 BF16 (the GEMM that matches the weights' packing), over a bf16 or an
 * 8-bit KV pool, in one OpenMP parallel region.
 *
 * Why: the same step through Python calls ten kernels per layer, each opening and closing a
 * parallel region, with the interpreter's work for the layer in between, during which the
 * other threads have nothing to do (a noticeable share of a decode step: bench/FIGURES.md).
 * Here the kernels run back to back, separated by barriers only.
 * The arithmetic is the same functions in the same order as the Python path
 * (pagedgen/model/layers/llama.py with the native kernels), so the results are bit-identical.
 */
#include <stddef.h>
#include <stdint.h>

#include "team_ops.h"

typedef struct {
    const uint16_t *input_norm, *post_attention_norm; /* [hidden] */
    /* amx_pack_weight layouts (gemm_common.h); the biases are [out] or NULL */
    const uint16_t *qkv, *qkv_bias, *o, *o_bias, *gate_up, *down;
} DecodeLayerWeights;

typedef struct {
    int64_t hidden, intermediate;
    int num_q_heads, num_kv_heads, head_dim, block_size;
    float rms_norm_eps, scale;
    int gemm_kind; /* GEMM_AMX or GEMM_AVX512: the kernel the layer-by-layer path uses */
} DecodeModelShape;

enum { GEMM_AMX = 0, GEMM_AVX512 = 1 };

/* out[T, n] = x[T, k] . W^T (+ bias) on this step's kernel, by the whole team. */
static void linear_team(const DecodeModelShape *s, const uint16_t *x, int64_t x_stride,
                        const uint16_t *packed, const uint16_t *bias, uint16_t *out, int64_t m,
                        int64_t n, int64_t k) {
    if (s->gemm_kind == GEMM_AVX512)
        avx512_linear_team(x, x_stride, packed, bias, out, m, n, k);
    else
        amx_linear_team(x, x_stride, packed, bias, out, m, n, k);
}

static int linear_supported(const DecodeModelShape *s, int64_t m, int64_t n, int64_t k) {
    if (s->gemm_kind == GEMM_AVX512) return avx512_linear_supported(m, n, k);
    return s->gemm_kind == GEMM_AMX && amx_linear_supported(m, n, k);
}

/* Rows: one per sequence. Buffers marked 16 have whole 16-row blocks (the AMX GEMM inputs and
 * outputs; rows past `tokens` are scratch; the AVX-512 GEMM reads and writes `tokens` rows). */
typedef struct {
    int64_t tokens;
    uint16_t *residual;      /* [T, hidden], updated in place */
    uint16_t *mlp_out;       /* 16 [T, hidden]: the last layer's MLP output on return */
    const uint16_t *cos_sin; /* [T, 2, head_dim / 2]: RoPE rows of the tokens' positions */
    const int64_t *slots;    /* [T]: cache slot of each new token, -1 = skip */
    void *kv_cache;          /* [layers, 2, blocks, block_size, kv_heads, head_dim]: bf16, or
                                8-bit codes when kv_codes != 0 */
    int64_t num_slots;       /* blocks * block_size */
    const int64_t *block_tables, *seq_lens; /* [T, max_blocks], [T] */
    int64_t max_blocks;
    /* scratch */
    uint16_t *normed;     /* 16 [T, hidden] */
    uint16_t *qkv;        /* 16 [T, (q_heads + 2 kv_heads) * head_dim] */
    uint16_t *qk_rotated; /* [T, q_heads + kv_heads, head_dim] */
    uint16_t *attended;   /* 16 [T, q_heads * head_dim] */
    uint16_t *attn_out;   /* 16 [T, hidden] */
    uint16_t *gate_up;    /* 16 [T, 2 intermediate] */
    uint16_t *activated;  /* 16 [T, intermediate] */
    /* 8-bit pools (DecodeAttention's kv_codes, 0: bf16): float32 scales [layers, 2, blocks,
     * kv_heads]; each new token in a block of its own (the caller checks) */
    float *kv_scales;
    int kv_codes;
    /* [layers]: each layer's sliding window (0: full attention), or NULL: none has one. The
     * tables are the same for every layer; the kernel skips blocks before a layer's window. */
    const int32_t *layer_windows;
} DecodeStepBuffers;

/* One layer's slice of the pool. */
typedef struct {
    void *k, *v;
    float *k_scales, *v_scales; /* NULL for bf16 pools */
} LayerCache;

/* The new tokens' K (rotated) and V into the pool, quantizing for an 8-bit one. */
static void store_new_kv(const DecodeModelShape *s, const DecodeStepBuffers *b,
                         const LayerCache *cache) {
    const int64_t D = s->head_dim, q_size = s->num_q_heads * D, kv_size = s->num_kv_heads * D;
    const int64_t qk_stride = (s->num_q_heads + s->num_kv_heads) * D * 2;
    const int64_t v_stride = (q_size + 2 * kv_size) * 2;
    const uint16_t *key = b->qk_rotated + q_size, *value = b->qkv + q_size + kv_size;
    if (b->kv_codes)
        store_kv_q8_team(key, qk_stride, value, v_stride, 1, cache->k, cache->v, cache->k_scales,
                         cache->v_scales, b->slots, b->tokens, s->num_kv_heads, D, s->block_size,
                         b->kv_codes);
    else
        store_kv_team(key, qk_stride, value, v_stride, cache->k, cache->v, b->slots, b->tokens,
                      kv_size * 2);
}

static void decoder_layer_team(const DecodeLayerWeights *w, const DecodeModelShape *s,
                               const DecodeStepBuffers *b, const LayerCache *cache, int window,
                               const uint16_t *pending, int *failed) {
    const int64_t T = b->tokens, H = s->hidden, I = s->intermediate, D = s->head_dim;
    const int64_t q_size = s->num_q_heads * D, kv_size = s->num_kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size, qk_heads = s->num_q_heads + s->num_kv_heads;
    add_rms_norm_team(b->residual, pending, w->input_norm, b->normed, T, H, s->rms_norm_eps);
    linear_team(s, b->normed, H, w->qkv, w->qkv_bias, b->qkv, T, qkv_size, H);
    rope_team(b->qkv, qkv_size, b->cos_sin, b->qk_rotated, T, qk_heads, D);
    store_new_kv(s, b, cache);
    const DecodeAttention attention = {
        b->qk_rotated, cache->k, cache->v, b->block_tables, b->seq_lens, b->attended,
        qk_heads * D, b->max_blocks, (int)T, s->num_q_heads, s->num_kv_heads, (int)D,
        s->block_size, 1, s->scale, cache->k_scales, cache->v_scales, b->kv_codes, window};
    decode_attention_team(&attention, failed);
    linear_team(s, b->attended, q_size, w->o, w->o_bias, b->attn_out, T, H, q_size);
    add_rms_norm_team(b->residual, b->attn_out, w->post_attention_norm, b->normed, T, H,
                      s->rms_norm_eps);
    linear_team(s, b->normed, H, w->gate_up, NULL, b->gate_up, T, 2 * I, H);
    silu_mul_team(b->gate_up, b->activated, T, I);
    linear_team(s, b->activated, I, w->down, NULL, b->mlp_out, T, H, I);
}

static int step_supported(const DecodeModelShape *s, const DecodeStepBuffers *b, int num_layers) {
    const int64_t T = b->tokens, H = s->hidden, I = s->intermediate, D = s->head_dim;
    const int64_t q_size = s->num_q_heads * D, kv_size = s->num_kv_heads * D;
    const DecodeAttention attention = {NULL, NULL, NULL, NULL, NULL, NULL,
                                       (s->num_q_heads + s->num_kv_heads) * D, b->max_blocks,
                                       (int)T, s->num_q_heads, s->num_kv_heads, (int)D,
                                       s->block_size, 1, s->scale, b->kv_scales, b->kv_scales,
                                       b->kv_codes};
    if (T < 1 || !decode_attention_supported(&attention)) return 0;
    for (int64_t t = 0; t < T; t++)
        if (b->slots[t] >= b->num_slots) return 0;
    for (int l = 0; b->layer_windows && l < num_layers; l++)
        if (b->layer_windows[l] < 0) return 0;
    return linear_supported(s, T, q_size + 2 * kv_size, H) &&
           linear_supported(s, T, H, q_size) && linear_supported(s, T, 2 * I, H) &&
           linear_supported(s, T, H, I);
}

/* Returns 0 when done, 1 when the shapes are not supported (nothing was touched: run the
 * Python path), 2 when a thread could not allocate its scratch (the step is lost). */
int decode_layers_bf16(const DecodeLayerWeights *layers, int num_layers,
                       const DecodeModelShape *shape, const DecodeStepBuffers *buffers,
                       int num_threads) {
    if (!step_supported(shape, buffers, num_layers)) return 1;
    const int64_t heads = shape->num_kv_heads, blocks = buffers->num_slots / shape->block_size;
    const int64_t cache_bytes = buffers->num_slots * heads * shape->head_dim *
                                (buffers->kv_codes ? 1 : 2);
    int failed = 0;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    for (int l = 0; l < num_layers; l++) {
        char *k_cache = (char *)buffers->kv_cache + 2 * l * cache_bytes;
        float *k_scales = buffers->kv_codes ? buffers->kv_scales + 2 * l * blocks * heads : NULL;
        const LayerCache cache = {k_cache, k_cache + cache_bytes, k_scales,
                                  k_scales ? k_scales + blocks * heads : NULL};
        decoder_layer_team(&layers[l], shape, buffers, &cache,
                           buffers->layer_windows ? buffers->layer_windows[l] : 0,
                           l == 0 ? NULL : buffers->mlp_out, &failed);
    }
    return failed ? 2 : 0;
}
