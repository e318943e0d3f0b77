/* The kernels' loops as OpenMP "team" functions: every thread of an enclosing parallel region
 * calls one, the work is shared out inside (orphaned `omp for` or an explicit split) and it
 * ends in a barrier. The Python-facing entry points wrap each in a region of its own;
 * decode_step.c runs a whole decode step in one region, calling them in turn.
 * Outside any region a team function runs everything on the calling thread. */
#ifndef PAGEDGEN_CPU_TEAM_OPS_H
#define PAGEDGEN_CPU_TEAM_OPS_H

#include <stdint.h>

/* fused_ops.c (bfloat16) */
void add_rms_norm_team(uint16_t *residual, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t dim, float eps);
void silu_mul_team(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter);
void rope_team(const uint16_t *x, int64_t row_stride, const uint16_t *cos_sin, uint16_t *out,
               int64_t tokens, int64_t heads, int64_t head_dim);
/* Gemma's (1 + w) RMSNorm, the residual add first when delta != NULL; and its GeGLU. */
void add_offset_rms_norm_team(uint16_t *residual, int64_t outer_stride, const uint16_t *delta,
                              const uint16_t *weight, int64_t weight_stride, uint16_t *out,
                              int64_t outer, int64_t inner, int64_t dim, float eps);
void gelu_tanh_mul_team(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter);

/* gemm_amx.c: x must have whole 16-row blocks readable. amx_available: the CPU has AMX
 * and Linux granted this process the tile state. */
int amx_available(void);
int amx_linear_supported(int64_t m, int64_t n, int64_t k);
void amx_linear_team(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                     const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k);

/* gemm_avx512.c: any rows (x needs no padding); same packing as the AMX kernel.
 * avx512_bf16_available: the build (-march=native) has AVX-512 BF16. */
int avx512_bf16_available(void);
int avx512_linear_supported(int64_t m, int64_t n, int64_t k);
void avx512_linear_team(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                        const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k);

/* gemm_avx2.c: any rows, same packing; *failed set when out of memory (nothing written). */
int avx2_linear_supported(int64_t m, int64_t n, int64_t k);
void avx2_linear_team(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                      const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k,
                      int *failed);

/* store_kv.c: slots already checked against the cache's capacity. */
void store_kv_team(const void *key, int64_t key_stride_bytes, const void *value,
                   int64_t value_stride_bytes, void *k_cache, void *v_cache, const int64_t *slots,
                   int64_t rows, int64_t row_bytes);

/* store_kv_q8.c: the quantizing store of an 8-bit pool (kv_codes as in DecodeAttention
 * below); each row in a block of its own, slots already checked. */
void store_kv_q8_team(const void *key, int64_t key_stride_bytes, const void *value,
                      int64_t value_stride_bytes, int is_bf16, void *k_cache, void *v_cache,
                      float *k_scales, float *v_scales, const int64_t *slots, int64_t rows,
                      int64_t heads, int64_t dim, int64_t block_size, int kv_codes);

/* decode_attention.c / decode_attention_bf16.c: one query token per sequence. */
typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    void *out;
    int64_t q_stride, max_blocks; /* q_stride: elements between sequences' query rows */
    int num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, is_bf16;
    float scale;
    /* 8-bit pools (kernels/kv_quant.py): kv_codes 1 = int8, 2 = fp8 e4m3, 3 = fp8 e5m2 (0: K/V
     * in the query's dtype); value = code * scales[block * num_kv_heads + kv head]. */
    const float *k_scales, *v_scales;
    int kv_codes;
    /* > 0: a query at position p sees keys in (p - W, p]; blocks wholly before the window are
     * not read (their table entries may name freed blocks). */
    int sliding_window;
    /* 1: neighbours whose tables begin with the same blocks are attended together, those
     * blocks read once (decode_shared_blocks.h; a row's last bit may then depend on its
     * neighbours); 0: each alone, a row's bits its query's and keys' alone (batch invariance). */
    int share_blocks;
} DecodeAttention;

/* The first key a decode query of a `len`-key context sees under `window` (0: none). */
static inline int64_t window_first_key(int64_t len, int window) {
    return window > 0 && len > window ? len - window : 0;
}

int decode_attention_supported(const DecodeAttention *args);
/* *failed is set (never cleared) when a thread could not allocate its scratch. */
void decode_attention_team(const DecodeAttention *args, int *failed);
int decode_attention_bf16_supported(const DecodeAttention *args);
/* decode_attention_q8.c: 8-bit pools on AVX-512 (kv_codes 1..3, block_size % 16 == 0). */
int decode_attention_q8_avx512_supported(const DecodeAttention *args);
void decode_attention_q8_avx512_team(const DecodeAttention *args, int *failed);
void decode_attention_bf16_team(const DecodeAttention *args, int *failed);
/* decode_attention_avx2.c: bf16 pools on AVX2 + FMA. decode_attention_kernel: which kernels
 * decode_attention_team may take (0 the fastest, 1 none of AVX-512, 2 the portable loop only;
 * for tests and benchmarks), -2 only asks; returns the setting. */
int decode_attention_avx2_supported(const DecodeAttention *args);
void decode_attention_avx2_team(const DecodeAttention *args, int *failed);
int decode_attention_kernel(int choice);

#endif
