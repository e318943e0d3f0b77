/* The decoder layers of a pure decode step (one new token per sequence) for bfloat16 on CPUs
 * with AMX, AVX-512 BF16 or AVX2 (the GEMM that matches the weights' packing), or on GGUF blocks as
 * stored (the GGUF library's gguf_linear_team), over a bf16 or an 8-bit KV pool, in one OpenMP
 * parallel region.
 *
 * Why: the same step through Python calls ten kernels per layer, each opening and closing a
 * parallel region, with the interpreter's work for the layer in between, during which the
 * other threads have nothing to do (a noticeable share of a decode step: bench/FIGURES.md).
 * Here the kernels run back to back, separated by barriers only.
 * The arithmetic is the same functions in the same order as the Python path
 * (pagedgen/model/layers/decoder.py's DecoderLayer with the native kernels), so the results
 * are bit-identical.
 *
 * What differs between families is data, as in the Python layers: the norm style (Llama's,
 * or Gemma's (1 + w) in float32), the gate activation (SiLU or GELU tanh), the attention
 * scale, Gemma's sandwich norms and per-head q/k norms (NULL weights where a model has none),
 * a RoPE table per distinct RoPE with each layer's index into them, each layer's window, and
 * for a hybrid KV pool (model/runtime/kv_groups.py) each layer's group (its block tables and
 * slots) and position in the pool. Qwen3's q/k norm (Llama style) is not here: the Python
 * layers run it in torch, whose float32 sum order this code cannot reproduce.
 */
#include <stddef.h>
#include <stdint.h>

#include "team_ops.h"

typedef struct {
    const uint16_t *input_norm, *post_attention_norm; /* [hidden] */
    /* Gemma's sandwich norms of the attention and MLP outputs ([hidden]), or NULL: none */
    const uint16_t *attention_out_norm, *mlp_out_norm;
    const uint16_t *qk_norm; /* [q_heads + kv_heads, head_dim]: per-head q/k norm, or NULL */
    /* The projections: amx_pack_weight layouts (gemm_common.h), or for GEMM_GGUF each a
     * GgufProjection (kernels/cpu/gguf/gguf_gemm.c: GGUF blocks as stored); the biases are
     * [out] or NULL */
    const void *qkv;
    const uint16_t *qkv_bias;
    const void *o;
    const uint16_t *o_bias;
    const void *gate_up, *down;
} DecodeLayerWeights;

/* kernels/cpu/gguf's gguf_linear_team, from whichever of its libraries the model loaded: that
 * library is built apart (one per kernel path), so the step gets the function's address. */
typedef void (*GgufLinearTeam)(const void *projection, const uint16_t *x, int64_t x_stride,
                               const uint16_t *bias, uint16_t *out, int64_t m_rows, float *y,
                               void *acts, int *failed);

typedef struct {
    int64_t hidden, intermediate;
    int num_q_heads, num_kv_heads, head_dim, block_size;
    float rms_norm_eps, scale;
    int gemm_kind;  /* GEMM_AMX, GEMM_AVX512, GEMM_AVX2 or GEMM_GGUF: the layer path's kernel */
    int norm_style; /* NORM_LLAMA or NORM_GEMMA (ArchitectureStyle.norm) */
    int activation; /* ACT_SILU or ACT_GELU_TANH (ModelConfig.hidden_act) */
    GgufLinearTeam gguf_linear; /* GEMM_GGUF only, else NULL */
} DecodeModelShape;

enum { GEMM_AMX = 0, GEMM_AVX512 = 1, GEMM_GGUF = 2, GEMM_AVX2 = 3 };
enum { NORM_LLAMA = 0, NORM_GEMMA = 1 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* One KV group's step metadata, shared by the layers of the group (a one-group pool: all). */
typedef struct {
    const int64_t *slots;                   /* [T]: cache slot of each new token, -1 = skip */
    const int64_t *block_tables, *seq_lens; /* [T, max_blocks], [T]: unshifted (window 0) */
    int64_t max_blocks;
} DecodeKVGroup;

/* Rows: one per sequence. Buffers marked 16 have whole 16-row blocks (the AMX GEMM inputs and
 * outputs; rows past `tokens` are scratch; the AVX-512 GEMM reads and writes `tokens` rows). */
typedef struct {
    int64_t tokens;
    uint16_t *residual; /* [T, hidden], updated in place */
    uint16_t *mlp_out;  /* 16 [T, hidden]: the last layer's MLP output on return */
    /* [num_ropes] tables [T, 2, head_dim / 2]: each distinct RoPE's rows of the tokens'
     * positions; layer_ropes [layers]: the table each layer applies, or NULL: table 0 */
    const uint16_t **rope_tables;
    const int32_t *layer_ropes;
    int num_ropes;
    void *kv_cache; /* [kv_positions, 2, blocks, block_size, kv_heads, head_dim]: bf16, or
                       8-bit codes when kv_codes != 0 */
    int64_t kv_positions, num_slots; /* num_slots: blocks * block_size */
    /* [num_groups]; layer_slots [layers, 2]: each layer's group and position in kv_cache, or
     * NULL: group 0, layer l at position l */
    const DecodeKVGroup *groups;
    int num_groups;
    const int32_t *layer_slots;
    /* scratch */
    uint16_t *normed;      /* 16 [T, hidden] */
    uint16_t *qkv;         /* 16 [T, (q_heads + 2 kv_heads) * head_dim] */
    uint16_t *qk_normed;   /* [T, q_heads + kv_heads, head_dim] (q/k norms only) */
    uint16_t *qk_rotated;  /* [T, q_heads + kv_heads, head_dim] */
    uint16_t *attended;    /* 16 [T, q_heads * head_dim] */
    uint16_t *attn_out;    /* 16 [T, hidden]; with sandwich norms also the raw MLP output */
    uint16_t *attn_normed; /* [T, hidden]: the attention output's sandwich norm */
    uint16_t *gate_up;     /* 16 [T, 2 intermediate] */
    uint16_t *activated;   /* 16 [T, intermediate] */
    /* 8-bit pools (DecodeAttention's kv_codes, 0: bf16): float32 scales [kv_positions, 2,
     * blocks, kv_heads]; each new token in a block of its own (the caller checks) */
    float *kv_scales;
    int kv_codes;
    /* [layers]: each layer's sliding window (0: full attention), or NULL: none has one. The
     * kernel skips blocks before a layer's window (a sliding group's released entries). */
    const int32_t *layer_windows;
    /* GEMM_GGUF's shared scratch: float32 [T, widest projection] and the quantized
     * activations (gguf_linear_scratch_bytes of T rows of the widest K); else NULL */
    float *gguf_out;
    void *gguf_acts;
} DecodeStepBuffers;

/* Where one layer reads and writes: its group's metadata, its slice of the pool, its window
 * and its RoPE rows. */
typedef struct {
    const DecodeKVGroup *group;
    void *k, *v;
    float *k_scales, *v_scales; /* NULL for bf16 pools */
    int window;
    const uint16_t *cos_sin;
} LayerPlace;

static int layer_group(const DecodeStepBuffers *b, int l) {
    return b->layer_slots ? b->layer_slots[2 * l] : 0;
}

static int64_t layer_position(const DecodeStepBuffers *b, int l) {
    return b->layer_slots ? b->layer_slots[2 * l + 1] : l;
}

static LayerPlace place_layer(const DecodeModelShape *s, const DecodeStepBuffers *b, int l) {
    const int64_t heads = s->num_kv_heads, blocks = b->num_slots / s->block_size;
    const int64_t cache_bytes = b->num_slots * heads * s->head_dim * (b->kv_codes ? 1 : 2);
    const int64_t position = layer_position(b, l);
    char *k = (char *)b->kv_cache + 2 * position * cache_bytes;
    float *k_scales = b->kv_codes ? b->kv_scales + 2 * position * blocks * heads : NULL;
    const LayerPlace place = {&b->groups[layer_group(b, l)], k, k + cache_bytes, k_scales,
                              k_scales ? k_scales + blocks * heads : NULL,
                              b->layer_windows ? b->layer_windows[l] : 0,
                              b->rope_tables[b->layer_ropes ? b->layer_ropes[l] : 0]};
    return place;
}

/* out[T, n] = x[T, k] . W^T (+ bias) on this step's kernel, by the whole team. */
static void linear_team(const DecodeModelShape *s, const DecodeStepBuffers *b, const uint16_t *x,
                        int64_t x_stride, const void *packed, const uint16_t *bias,
                        uint16_t *out, int64_t m, int64_t n, int64_t k, int *failed) {
    if (s->gemm_kind == GEMM_GGUF)
        s->gguf_linear(packed, x, x_stride, bias, out, m, b->gguf_out, b->gguf_acts, failed);
    else if (s->gemm_kind == GEMM_AVX512)
        avx512_linear_team(x, x_stride, packed, bias, out, m, n, k);
    else if (s->gemm_kind == GEMM_AVX2)
        avx2_linear_team(x, x_stride, packed, bias, out, m, n, k, failed);
    else
        amx_linear_team(x, x_stride, packed, bias, out, m, n, k);
}

/* GEMM_GGUF: the caller sized the scratch and checked the projections' shapes. */
static int linear_supported(const DecodeModelShape *s, const DecodeStepBuffers *b, int64_t m,
                            int64_t n, int64_t k) {
    if (s->gemm_kind == GEMM_GGUF) return s->gguf_linear && b->gguf_out && b->gguf_acts;
    if (s->gemm_kind == GEMM_AVX512) return avx512_linear_supported(m, n, k);
    if (s->gemm_kind == GEMM_AVX2) return avx2_linear_supported(m, n, k);
    return s->gemm_kind == GEMM_AMX && amx_linear_supported(m, n, k);
}

/* The model's RMSNorm of [rows, hidden], after residual += delta when delta != NULL (the
 * residual add and the norm are one kernel on the layer path too: RMSNorm.forward). */
static void norm_team(const DecodeModelShape *s, uint16_t *residual, const uint16_t *delta,
                      const uint16_t *weight, uint16_t *out, int64_t rows) {
    if (s->norm_style == NORM_GEMMA)
        add_offset_rms_norm_team(residual, s->hidden, delta, weight, 0, out, rows, 1, s->hidden,
                                 s->rms_norm_eps);
    else
        add_rms_norm_team(residual, delta, weight, out, rows, s->hidden, s->rms_norm_eps);
}

/* q and k heads of the QKV output rotated into qk_rotated, normed per head first where the
 * model has q/k norms (the layer path's order: norm, then RoPE). Only Gemma's norm style
 * gets here with them (step_supported). */
static void rotate_qk(const DecodeLayerWeights *w, const DecodeModelShape *s,
                      const DecodeStepBuffers *b, const uint16_t *cos_sin) {
    const int64_t T = b->tokens, D = s->head_dim, qk_heads = s->num_q_heads + s->num_kv_heads;
    const int64_t qkv_size = (qk_heads + s->num_kv_heads) * D;
    const uint16_t *qk = b->qkv;
    int64_t row_stride = qkv_size;
    if (w->qk_norm) {
        add_offset_rms_norm_team(b->qkv, qkv_size, NULL, w->qk_norm, D, b->qk_normed, T,
                                 qk_heads, D, s->rms_norm_eps);
        qk = b->qk_normed;
        row_stride = qk_heads * D;
    }
    rope_team(qk, row_stride, cos_sin, b->qk_rotated, T, qk_heads, D);
}

/* The new tokens' K (rotated) and V into the pool, quantizing for an 8-bit one. */
static void store_new_kv(const DecodeModelShape *s, const DecodeStepBuffers *b,
                         const LayerPlace *place) {
    const int64_t D = s->head_dim, q_size = s->num_q_heads * D, kv_size = s->num_kv_heads * D;
    const int64_t qk_stride = (s->num_q_heads + s->num_kv_heads) * D * 2;
    const int64_t v_stride = (q_size + 2 * kv_size) * 2;
    const uint16_t *key = b->qk_rotated + q_size, *value = b->qkv + q_size + kv_size;
    const int64_t *slots = place->group->slots;
    if (b->kv_codes)
        store_kv_q8_team(key, qk_stride, value, v_stride, 1, place->k, place->v, place->k_scales,
                         place->v_scales, slots, b->tokens, s->num_kv_heads, D, s->block_size,
                         b->kv_codes);
    else
        store_kv_team(key, qk_stride, value, v_stride, place->k, place->v, slots, b->tokens,
                      kv_size * 2);
}

/* normed -> the attention output in attn_out (o_proj included). */
static void attention_team(const DecodeLayerWeights *w, const DecodeModelShape *s,
                           const DecodeStepBuffers *b, const LayerPlace *place, int *failed) {
    const int64_t T = b->tokens, H = s->hidden, D = s->head_dim;
    const int64_t q_size = s->num_q_heads * D, kv_size = s->num_kv_heads * D;
    const int64_t qk_heads = s->num_q_heads + s->num_kv_heads;
    linear_team(s, b, b->normed, H, w->qkv, w->qkv_bias, b->qkv, T, q_size + 2 * kv_size, H,
                failed);
    rotate_qk(w, s, b, place->cos_sin);
    store_new_kv(s, b, place);
    const DecodeKVGroup *g = place->group;
    const DecodeAttention attention = {
        b->qk_rotated, place->k, place->v, g->block_tables, g->seq_lens, b->attended,
        qk_heads * D, g->max_blocks, (int)T, s->num_q_heads, s->num_kv_heads, (int)D,
        s->block_size, 1, s->scale, place->k_scales, place->v_scales, b->kv_codes,
        place->window, 1};
    decode_attention_team(&attention, failed);
    linear_team(s, b, b->attended, q_size, w->o, w->o_bias, b->attn_out, T, H, q_size, failed);
}

/* normed -> the layer's MLP output in mlp_out (after its sandwich norm where it has one; the
 * raw output then goes to attn_out, free by now). */
static void mlp_team(const DecodeLayerWeights *w, const DecodeModelShape *s,
                     const DecodeStepBuffers *b, int *failed) {
    const int64_t T = b->tokens, H = s->hidden, I = s->intermediate;
    linear_team(s, b, b->normed, H, w->gate_up, NULL, b->gate_up, T, 2 * I, H, failed);
    if (s->activation == ACT_GELU_TANH)
        gelu_tanh_mul_team(b->gate_up, b->activated, T, I);
    else
        silu_mul_team(b->gate_up, b->activated, T, I);
    uint16_t *down = w->mlp_out_norm ? b->attn_out : b->mlp_out;
    linear_team(s, b, b->activated, I, w->down, NULL, down, T, H, I, failed);
    if (w->mlp_out_norm) norm_team(s, down, NULL, w->mlp_out_norm, b->mlp_out, T);
}

/* DecoderLayer.forward: residual += pending, attention, MLP; the MLP output in mlp_out. */
static void decoder_layer_team(const DecodeLayerWeights *w, const DecodeModelShape *s,
                               const DecodeStepBuffers *b, const LayerPlace *place,
                               const uint16_t *pending, int *failed) {
    const int64_t T = b->tokens;
    norm_team(s, b->residual, pending, w->input_norm, b->normed, T);
    attention_team(w, s, b, place, failed);
    const uint16_t *attended = b->attn_out;
    if (w->attention_out_norm) {
        norm_team(s, b->attn_out, NULL, w->attention_out_norm, b->attn_normed, T);
        attended = b->attn_normed;
    }
    norm_team(s, b->residual, attended, w->post_attention_norm, b->normed, T);
    mlp_team(w, s, b, failed);
}

/* Each layer's group, position, RoPE table and window within what the buffers hold. */
static int layers_supported(const DecodeLayerWeights *layers, int num_layers,
                            const DecodeModelShape *s, const DecodeStepBuffers *b) {
    for (int l = 0; l < num_layers; l++) {
        const int group = layer_group(b, l), rope = b->layer_ropes ? b->layer_ropes[l] : 0;
        const int64_t position = layer_position(b, l);
        if (group < 0 || group >= b->num_groups || position < 0 || position >= b->kv_positions)
            return 0;
        if (rope < 0 || rope >= b->num_ropes || (b->layer_windows && b->layer_windows[l] < 0))
            return 0;
        if (layers[l].qk_norm && s->norm_style != NORM_GEMMA) return 0;
    }
    return 1;
}

static int groups_supported(const DecodeModelShape *s, const DecodeStepBuffers *b) {
    const int64_t D = s->head_dim;
    if (b->num_groups < 1) return 0;
    for (int g = 0; g < b->num_groups; g++) {
        const DecodeAttention attention = {NULL, NULL, NULL, NULL, NULL, NULL,
                                           (s->num_q_heads + s->num_kv_heads) * D,
                                           b->groups[g].max_blocks, (int)b->tokens,
                                           s->num_q_heads, s->num_kv_heads, (int)D,
                                           s->block_size, 1, s->scale, b->kv_scales,
                                           b->kv_scales, b->kv_codes, 0};
        if (!decode_attention_supported(&attention)) return 0;
        for (int64_t t = 0; t < b->tokens; t++)
            if (b->groups[g].slots[t] >= b->num_slots) return 0;
    }
    return 1;
}

static int step_supported(const DecodeLayerWeights *layers, int num_layers,
                          const DecodeModelShape *s, const DecodeStepBuffers *b) {
    const int64_t T = b->tokens, H = s->hidden, I = s->intermediate, D = s->head_dim;
    const int64_t q_size = s->num_q_heads * D, kv_size = s->num_kv_heads * D;
    if (T < 1 || b->num_ropes < 1 || (s->norm_style != NORM_LLAMA && s->norm_style != NORM_GEMMA)
        || (s->activation != ACT_SILU && s->activation != ACT_GELU_TANH))
        return 0;
    if (!groups_supported(s, b) || !layers_supported(layers, num_layers, s, b)) return 0;
    return linear_supported(s, b, T, q_size + 2 * kv_size, H) &&
           linear_supported(s, b, T, H, q_size) && linear_supported(s, b, T, 2 * I, H) &&
           linear_supported(s, b, T, H, I);
}

/* Returns 0 when done, 1 when the shapes are not supported (nothing was touched: run the
 * Python path), 2 when a thread could not allocate its scratch (the step is lost). */
int decode_layers_bf16(const DecodeLayerWeights *layers, int num_layers,
                       const DecodeModelShape *shape, const DecodeStepBuffers *buffers,
                       int num_threads) {
    if (!step_supported(layers, num_layers, shape, buffers)) return 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    for (int l = 0; l < num_layers; l++) {
        const LayerPlace place = place_layer(shape, buffers, l);
        decoder_layer_team(&layers[l], shape, buffers, &place, l == 0 ? NULL : buffers->mlp_out,
                           &failed);
    }
    return failed ? 2 : 0;
}
