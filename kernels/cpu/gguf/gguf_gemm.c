/* y = x @ W^T with W kept in GGUF's packed blocks, and row look-ups (dequantize) of W.
 *
 * One source, compiled once per path by build.py with different target flags: the GEMM picks
 * AVX-512, AVX2 or plain C by what the compiler was told it may use, so each library is
 * exactly one path and the AVX2 and portable ones can be tested on any x86 CPU. The AVX-512
 * and AVX2 libraries decode weight blocks in registers inside the dot product
 * (gguf_registers.c, included below); the portable one unpacks tiles, as follows.
 *
 * How the tile path forms a product (the same for every weight type):
 *  - activations: each row of x is quantized in blocks of 32 to int8 with one float scale
 *    d_a = amax/127 per block, and the float sums d_a * sum(q) of each half-block of 16 are
 *    kept (they carry the weights' offsets and minimums, as llama.cpp's Q8_1 sums do);
 *  - weights: a tile of rows is unpacked once into unsigned codes (0..15, 0..31, 0..63, or the
 *    signed int8 of Q8_0), one float scale per 16 codes and one float "bias" per 16 codes, so
 *    that w = scale * code + bias / (value of the half-block's activation sum) holds:
 *    w_j = scale * code_j + offset, and sum_j w_j x_j = scale * dot(code, q) * d_a
 *                                                       + offset * d_a * sum(q);
 *  - the int8 dot products run on the unpacked tile for every activation row, so unpacking
 *    is paid once per tile, not once per row of x.
 * Every type's weights become (code, scale, offset) per 16 values: Q6_K's scales really are
 * per 16; for the others the two halves of a 32-block share theirs.
 *
 * Each library also exports gguf_linear_team (end of this file): a whole projection computed
 * by the threads of the caller's parallel region, for the fused decode step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../x86_common.h"  /* amx_tile_state_granted, and the AVX-512 helpers where built */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__linux__)
#define GGUF_PATH "amx_bf16"
#define IN_REGISTERS 1  /* avx512_bf16's library, its bf16 tiles on AMX (gguf_amx_tiles.c) */
#elif defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GGUF_PATH "avx512_bf16"
#define IN_REGISTERS 1  /* the AVX-512 VNNI kernel, and gguf_bf16_tiles.c for bf16 rows */
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define GGUF_PATH "avx512_vnni"
#define IN_REGISTERS 1  /* gguf_avx512.c: weight blocks decoded in registers */
#elif defined(__AVX2__)
#define GGUF_PATH "avx2"
#define IN_REGISTERS 1  /* gguf_avx2.c: the same design on 256-bit vectors */
#else
#define GGUF_PATH "portable"
#endif
#if !defined(IN_REGISTERS)
#define IN_REGISTERS 0  /* the portable library unpacks tiles of weight rows */
#endif

enum {  /* ggml's type numbers, as stored in the file */
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
};
#define TILE_ROWS 8  /* weight rows unpacked together; their codes stay in L1 across x's rows */
#define RESIDUAL 254  /* second activation code's step: the first's / RESIDUAL */
#define SMALL_PRODUCT (1 << 18)  /* multiply-adds below which one thread does the whole GEMM */
enum { SPANS_BLOCKS = 1, SPANS_SUPERS = 2 };  /* activation spans to quantize (gguf_registers.c) */

const char *gguf_path_name(void) { return GGUF_PATH; }

/* 1 when this CPU can run the library's path (the portable library answers for all three). */
int gguf_cpu_supports(int path) {
    __builtin_cpu_init();
    switch (path) {
    case 0: return 1;
    case 1: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
    case 2: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                   __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case 3: return gguf_cpu_supports(2) && __builtin_cpu_supports("avx512bf16");
    case 4: return gguf_cpu_supports(3) && __builtin_cpu_supports("amx-tile") &&
                   __builtin_cpu_supports("amx-bf16") && amx_tile_state_granted();
    default: return 0;
    }
}

#if defined(__F16C__)
static inline float half_to_float(const uint8_t *p) {
    return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8)));
}
#else
static float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0) {  /* zero or subnormal: mantissa * 2^-24 */
        float value = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -value : value;
    }
    if (exponent == 31) bits = sign | 0x7f800000u | (mantissa << 13);
    else bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    float out;
    memcpy(&out, &bits, 4);
    return out;
}
#endif

/* ---- block layouts (ggml-common.h) --------------------------------------------------------- */

static int block_values(int type) { return type >= T_Q4_K ? 256 : 32; }

static int block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;  case T_Q4_1: return 20;  case T_Q5_0: return 22;
    case T_Q5_1: return 24;  case T_Q8_0: return 34;  case T_Q4_K: return 144;
    case T_Q5_K: return 176; case T_Q6_K: return 210; default: return 0;
    }
}

static uint16_t float_to_bf16(float value) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* Scratch carved into 64-byte-aligned arrays: the next array of `bytes` at *at, which moves
 * past it (the activation scratch of either library: activations_at). */
static void *next_array(uintptr_t *at, int64_t bytes) {
    void *array = (void *)((*at + 63) & ~(uintptr_t)63);
    *at = (uintptr_t)array + (uintptr_t)bytes;
    return array;
}

#if !IN_REGISTERS  /* the tile path: the portable library */

/* ---- weight blocks -> codes, per-16 scales and offsets ------------------------------------ */

typedef struct {
    uint8_t *codes;  /* K codes (int8 for Q8_0, stored in the same bytes) */
    float *scale;    /* K/16 */
    float *offset;   /* K/16 */
} UnpackedRow;

static void set_pair(UnpackedRow *row, int64_t half, float scale, float offset) {
    row->scale[half] = row->scale[half + 1] = scale;
    row->offset[half] = row->offset[half + 1] = offset;
}

static void split_nibbles(uint8_t *codes, const uint8_t *qs, int n) {
    for (int j = 0; j < n; j++) { codes[j] = qs[j] & 15; codes[j + n] = qs[j] >> 4; }
}

static void nibbles(uint8_t *codes, const uint8_t *qs) {  /* low nibbles, then high nibbles */
    split_nibbles(codes, qs, 16);
}

static void fifth_bits(uint8_t *codes, const uint8_t *qh_bytes) {
    uint32_t qh = (uint32_t)qh_bytes[0] | (uint32_t)qh_bytes[1] << 8 |
                  (uint32_t)qh_bytes[2] << 16 | (uint32_t)qh_bytes[3] << 24;
    for (int j = 0; j < 32; j++) codes[j] |= (uint8_t)(((qh >> j) & 1u) << 4);
}

/* Q4_K/Q5_K: 8 scales and 8 mins of 6 bits packed into 12 bytes (ggml's get_scale_min_k4). */
static void scale_min_k4(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) { *scale = q[j] & 63; *min = q[j + 4] & 63; }
    else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static void unpack_small_block(int type, const uint8_t *b, UnpackedRow *row, int64_t block) {
    uint8_t *codes = row->codes + block * 32;
    float d = half_to_float(b);
    switch (type) {
    case T_Q4_0: nibbles(codes, b + 2); set_pair(row, 2 * block, d, -8.0f * d); break;
    case T_Q4_1: nibbles(codes, b + 4); set_pair(row, 2 * block, d, half_to_float(b + 2)); break;
    case T_Q5_0: nibbles(codes, b + 6); fifth_bits(codes, b + 2);
                 set_pair(row, 2 * block, d, -16.0f * d); break;
    case T_Q5_1: nibbles(codes, b + 8); fifth_bits(codes, b + 4);
                 set_pair(row, 2 * block, d, half_to_float(b + 2)); break;
    case T_Q8_0: memcpy(codes, b + 2, 32); set_pair(row, 2 * block, d, 0.0f); break;
    }
}

static void unpack_k4_k5(int type, const uint8_t *b, UnpackedRow *row, int64_t block) {
    uint8_t *codes = row->codes + block * 256;
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (type == T_Q5_K ? 48 : 16);
    for (int chunk = 0; chunk < 4; chunk++)  /* 64 values: low nibbles then high nibbles */
        split_nibbles(codes + 64 * chunk, qs + 32 * chunk, 32);
    if (type == T_Q5_K)  /* bit 2c of qh[l] tops value l of chunk c, bit 2c+1 value 32 + l */
        for (int chunk = 0; chunk < 4; chunk++)
            for (int l = 0; l < 32; l++) {
                codes[64 * chunk + l] |= (uint8_t)(((qh[l] >> (2 * chunk)) & 1) << 4);
                codes[64 * chunk + 32 + l] |= (uint8_t)(((qh[l] >> (2 * chunk + 1)) & 1) << 4);
            }
    for (int sub = 0; sub < 8; sub++) {
        int scale, min;
        scale_min_k4(sub, scales, &scale, &min);
        set_pair(row, block * 16 + 2 * sub, d * (float)scale, -dmin * (float)min);
    }
}

static void unpack_q6_k(const uint8_t *b, UnpackedRow *row, int64_t block) {
    uint8_t *codes = row->codes + block * 256;
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    float d = half_to_float(b + 208);
    for (int half = 0; half < 2; half++) {
        const uint8_t *l4 = ql + 64 * half, *h2 = qh + 32 * half;
        uint8_t *out = codes + 128 * half;
        for (int l = 0; l < 32; l++) {
            out[l] = (uint8_t)((l4[l] & 15) | ((h2[l] & 3) << 4));
            out[l + 32] = (uint8_t)((l4[l + 32] & 15) | (((h2[l] >> 2) & 3) << 4));
            out[l + 64] = (uint8_t)((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4));
            out[l + 96] = (uint8_t)((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4));
        }
    }
    for (int j = 0; j < 16; j++) {  /* the 16 scales are in value order, one per 16 values */
        float scale = d * (float)scales[j];
        row->scale[block * 16 + j] = scale;
        row->offset[block * 16 + j] = -32.0f * scale;
    }
}

static void unpack_row(int type, const uint8_t *w, int64_t k, UnpackedRow *row) {
    int64_t blocks = k / block_values(type);
    int size = block_bytes(type);
    for (int64_t block = 0; block < blocks; block++) {
        const uint8_t *b = w + block * size;
        if (type == T_Q6_K) unpack_q6_k(b, row, block);
        else if (type == T_Q4_K || type == T_Q5_K) unpack_k4_k5(type, b, row, block);
        else unpack_small_block(type, b, row, block);
    }
}

/* ---- activations: int8 per block of 32 ----------------------------------------------------- */

static float load_x(const void *x, int bf16, int64_t index) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[index]) : ((const float *)x)[index];
}

/* Two int8 codes per value: q1 = round(x / d) with d = amax / 127, then the remainder
 * (|x - d q1| <= d / 2) coded again, q2 = round((x - d q1) / (d / RESIDUAL)); so
 * x = (d / RESIDUAL) * (RESIDUAL q1 + q2) to within d / (2 RESIDUAL), near bf16's own
 * rounding, where one int8 code alone flips a few percent of a small model's top-1 tokens.
 * q: 2K int8, per block of 32 its q1 then its q2; scales: K/32 (d / RESIDUAL);
 * sums: K/16 (the half-block's sum of decoded activations). */
static void quantize_row(const void *x, int bf16, int64_t base, int64_t k, int8_t *q,
                         float *scales, float *sums) {
    float values[32];
    for (int64_t block = 0; block < k / 32; block++) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            values[j] = load_x(x, bf16, base + block * 32 + j);
            amax = fmaxf(amax, fabsf(values[j]));
        }
        float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum[2] = {0, 0};
        int8_t *q1 = q + 64 * block, *q2 = q1 + 32;
        for (int j = 0; j < 32; j++) {
            int code = (int)lrintf(values[j] * inverse);
            code = code > 127 ? 127 : code < -127 ? -127 : code;
            int rest = (int)lrintf((values[j] - d * (float)code) * inverse * RESIDUAL);
            rest = rest > 127 ? 127 : rest < -127 ? -127 : rest;
            q1[j] = (int8_t)code;
            q2[j] = (int8_t)rest;
            sum[j >> 4] += RESIDUAL * code + rest;
        }
        scales[block] = d / (float)RESIDUAL;
        sums[2 * block] = scales[block] * (float)sum[0];
        sums[2 * block + 1] = scales[block] * (float)sum[1];
    }
}

/* ---- the dot product of one unpacked weight row with one quantized activation row ---------- */

static float dot_row(const UnpackedRow *w, const int8_t *q, const float *scales,
                     const float *sums, int64_t k, int signed_codes) {
    float total = 0.0f;
    for (int64_t half = 0; half < k / 16; half++) {
        const uint8_t *codes = w->codes + 16 * half;
        const int8_t *q1 = q + 64 * (half / 2) + 16 * (half % 2), *q2 = q1 + 32;
        int32_t first = 0, second = 0;
        if (signed_codes)
            for (int j = 0; j < 16; j++) {
                first += (int8_t)codes[j] * q1[j];
                second += (int8_t)codes[j] * q2[j];
            }
        else
            for (int j = 0; j < 16; j++) { first += codes[j] * q1[j]; second += codes[j] * q2[j]; }
        int32_t dot = RESIDUAL * first + second;
        total += w->scale[half] * scales[half / 2] * (float)dot + w->offset[half] * sums[half];
    }
    return total;
}

#endif  /* !IN_REGISTERS */

/* ---- entry points --------------------------------------------------------------------------- */

static int check_shape(int type, int64_t k) {
    return block_bytes(type) > 0 && k > 0 && k % block_values(type) == 0;
}

static const uint8_t *weight_row(const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                                 int64_t n) {
    return w + (row_map ? row_map[n] : n) * row_bytes;
}

#if !IN_REGISTERS
static int alloc_row(UnpackedRow *row, int64_t k) {
    row->codes = malloc((size_t)k);
    row->scale = malloc(sizeof(float) * (size_t)(k / 16));
    row->offset = malloc(sizeof(float) * (size_t)(k / 16));
    return row->codes && row->scale && row->offset;
}

static void free_row(UnpackedRow *row) { free(row->codes); free(row->scale); free(row->offset); }

typedef struct {  /* quantize_row's arrays for a run of rows */
    int8_t *q;      /* M x 2K */
    float *scales;  /* M x K/32 */
    float *sums;    /* M x K/16 */
} Activations;

static int64_t activation_bytes(int64_t m_rows, int64_t k) {
    return 2 * m_rows * k + m_rows * (k / 32) * 4 + m_rows * (k / 16) * 4 + 3 * 64;
}

static Activations activations_at(void *scratch, int64_t m_rows, int64_t k) {
    uintptr_t at = (uintptr_t)scratch;
    Activations a;
    a.q = next_array(&at, 2 * m_rows * k);
    a.scales = next_array(&at, m_rows * (k / 32) * 4);
    a.sums = next_array(&at, m_rows * (k / 16) * 4);
    return a;
}

/* Team functions (team_ops.h's convention: every thread of the region calls them, the work is
 * shared out inside, they end in a barrier), as gguf_registers.c has them. */
static void quantize_rows_team(const void *x, int x_bf16, int64_t x_stride, int64_t m_rows,
                               int64_t k, const Activations *a, int spans) {
    (void)spans;  /* one kind of activation rows serves every type here */
#pragma omp for schedule(static)
    for (int64_t m = 0; m < m_rows; m++)
        quantize_row(x, x_bf16, m * x_stride, k, a->q + 2 * m * k, a->scales + m * (k / 32),
                     a->sums + m * (k / 16));
}

static int spans_for(int type) {
    (void)type;
    return SPANS_BLOCKS;
}

/* 0 where this thread could not allocate its tile (its tiles are skipped). */
static int products_team(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                         int64_t n_rows, int64_t k, const Activations *a, int64_t m_rows,
                         float *y, int64_t y_stride) {
    UnpackedRow tile[TILE_ROWS];
    int ok = 1;
    for (int r = 0; r < TILE_ROWS; r++) ok &= alloc_row(&tile[r], k);
    const int signed_codes = type == T_Q8_0;
#pragma omp for schedule(static)
    for (int64_t first = 0; first < n_rows; first += TILE_ROWS) {
        if (!ok) continue;
        int rows = (int)(n_rows - first < TILE_ROWS ? n_rows - first : TILE_ROWS);
        for (int r = 0; r < rows; r++)
            unpack_row(type, weight_row(w, row_bytes, row_map, first + r), k, &tile[r]);
        for (int64_t m = 0; m < m_rows; m++)
            for (int r = 0; r < rows; r++)
                y[m * y_stride + first + r] = dot_row(&tile[r], a->q + 2 * m * k,
                                                      a->scales + m * (k / 32),
                                                      a->sums + m * (k / 16), k, signed_codes);
    }
    for (int r = 0; r < TILE_ROWS; r++) free_row(&tile[r]);
    return ok;
}
#endif

#if IN_REGISTERS
#include "gguf_registers.c"
#endif

/* 1 when this library's GEMM decodes weight blocks in registers, 0 when it unpacks tiles. */
int gguf_decodes_in_registers(void) { return IN_REGISTERS; }

/* 1 when this library has the bf16 tile GEMM (gguf_bf16_tiles.c). */
int gguf_has_bf16_tiles(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if !defined(__AVX512BF16__)
int gguf_bf16_tiles_form(int form) { return 0; } /* no tiles: nothing to choose */
#endif

/* gguf_gemm's int8 route: x's rows quantized once (quantize_rows_team), then the products. */
static int gemm_quantized(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                          int64_t n_rows, int64_t k, const void *x, int x_bf16, int64_t x_stride,
                          int64_t m_rows, float *y, int64_t y_stride, int threads) {
    void *scratch = malloc((size_t)activation_bytes(m_rows, k));
    if (!scratch) return 2;
    Activations a = activations_at(scratch, m_rows, k);
    int status = 0;
#pragma omp parallel num_threads(threads)
    {  /* one region: quantize x, then (after the barrier) the products */
        quantize_rows_team(x, x_bf16, x_stride, m_rows, k, &a, spans_for(type));
        if (!products_team(type, w, row_bytes, row_map, n_rows, k, &a, m_rows, y, y_stride)) {
#pragma omp atomic write
            status = 2;
        }
    }
    free(scratch);
    return status;
}

/* y[m, n] (float32, row stride y_stride) = sum_k x[m, k] * W[row_map[n] or n, k].
 * w: the tensor's blocks, row_bytes apart; x: float32 or bf16 (x_bf16), row stride x_stride.
 * bf16_from_rows: bf16 x of at least this many rows runs the bf16 tile GEMM where the library
 * has it (0: never; the caller chooses, so that batch-invariant mode can keep one kernel).
 * round_to_bf16: each output rounded to bf16 (nearest even) and kept in float32, i.e. the bf16
 * product widened, as the dense GEMM gives the LM head its float32 logits, done while the
 * outputs are still in cache rather than by two conversions of the whole output afterwards.
 * Returns 0 done, 1 unsupported type or shape, 2 out of memory. */
int gguf_gemm(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
              int64_t n_rows, int64_t k, const void *x, int x_bf16, int64_t x_stride,
              int64_t m_rows, float *y, int64_t y_stride, int threads, int64_t bf16_from_rows,
              int round_to_bf16) {
    if (!check_shape(type, k)) return 1;
    if (threads < 1) threads = 1;
    /* Small products run on the calling thread: a team's fork and join cost more there. */
    if (m_rows * n_rows * k < SMALL_PRODUCT) threads = 1;
#if defined(__AVX512BF16__)
    if (x_bf16 && bf16_from_rows > 0 && m_rows >= bf16_from_rows)
        return gemm_bf16_tiles(type, w, row_bytes, row_map, n_rows, k, (const uint16_t *)x,
                               x_stride, m_rows, y, y_stride, threads, round_to_bf16);
#else
    (void)bf16_from_rows;
#endif
    int status = gemm_quantized(type, w, row_bytes, row_map, n_rows, k, x, x_bf16, x_stride,
                                m_rows, y, y_stride, threads);
    if (status == 0 && round_to_bf16) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t m = 0; m < m_rows; m++)
            for (int64_t j = 0; j < n_rows; j++)
                y[m * y_stride + j] = bf16_to_float(float_to_bf16(y[m * y_stride + j]));
    }
    return status;
}

#if !IN_REGISTERS
/* One unpacked row as values: scale * code + offset (the offset is per unit of activation in
 * a product, so as a weight it is just added). Branch-free inner loops, so they vectorize. */
static void write_values(const UnpackedRow *row, int64_t k, int signed_codes, void *out,
                         int out_bf16, int64_t base) {
    float values[16];
    for (int64_t half = 0; half < k / 16; half++) {
        const uint8_t *codes = row->codes + 16 * half;
        float scale = row->scale[half], offset = row->offset[half];
        if (signed_codes) for (int j = 0; j < 16; j++) values[j] = scale * (float)(int8_t)codes[j] + offset;
        else for (int j = 0; j < 16; j++) values[j] = scale * (float)codes[j] + offset;
        if (out_bf16) {
            uint16_t *dst = (uint16_t *)out + base + 16 * half;
            for (int j = 0; j < 16; j++) dst[j] = float_to_bf16(values[j]);
        } else {
            memcpy((float *)out + base + 16 * half, values, sizeof(values));
        }
    }
}
#endif

/* out[i, :] = W[row_map[i] or i, :] as float32 (out_bf16 = 0) or bf16 (rounded to nearest
 * even), row stride out_stride elements: embedding look-ups and dequantized weight tiles. */
int gguf_dequantize_rows(int type, const uint8_t *w, int64_t row_bytes, const int64_t *row_map,
                         int64_t n_rows, int64_t k, void *out, int out_bf16, int64_t out_stride,
                         int threads) {
    if (!check_shape(type, k)) return 1;
    if (threads < 1) threads = 1;
#if IN_REGISTERS  /* decoded in registers, as the GEMM does */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n_rows; i++) {
        void *at = out_bf16 ? (void *)((uint16_t *)out + i * out_stride)
                            : (void *)((float *)out + i * out_stride);
        decode_row_values(type, weight_row(w, row_bytes, row_map, i), k, at, out_bf16);
    }
    return 0;
#else
    int status = 0;
#pragma omp parallel num_threads(threads)
    {
        UnpackedRow row;
        int ok = alloc_row(&row, k);
        if (!ok) {
#pragma omp atomic write
            status = 2;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_rows; i++) {
            if (!ok) continue;
            unpack_row(type, weight_row(w, row_bytes, row_map, i), k, &row);
            write_values(&row, k, type == T_Q8_0, out, out_bf16, i * out_stride);
        }
        free_row(&row);
    }
    return status;
#endif
}

/* ---- a whole projection inside the caller's parallel region: the fused decode step ---------- */

/* A run of output columns: the rows of one GGUF tensor (a projection's q, k or v, its gate or
 * up, or all of it). Mirrored in kernels/cpu/gguf/team.py. */
typedef struct {
    const uint8_t *blocks;
    const int64_t *row_map;  /* [rows]: the tensor row of each output column, or NULL */
    int64_t row_bytes, rows;
    int type;
} GgufPart;

#define GGUF_MAX_PARTS 3  /* q, k and v */

typedef struct {
    GgufPart parts[GGUF_MAX_PARTS];
    int num_parts;
    int64_t k;
    int64_t bf16_from_rows;  /* as gguf_gemm's */
} GgufProjection;

/* Bytes of the shared activation scratch gguf_linear_team needs for m_rows rows of k values. */
int64_t gguf_linear_scratch_bytes(int64_t m_rows, int64_t k) { return activation_bytes(m_rows, k); }

/* out[m, N] (bf16) = x[m, K] (bf16) . W^T + bias (bf16 [N] or NULL), W the projection's parts
 * side by side. This is what quantized_linear computes part by part through gguf_gemm: the
 * same kernels (each output column is computed by one thread, whatever the team's size), then
 * the float32 sum plus the bias rounded to nearest even once, as torch rounds; so the fused
 * decode step is bit-identical to the layer path. x's rows are quantized once for all parts.
 * A team function (team_ops.h): every thread of the caller's region calls it, and it ends in
 * a barrier. y: float32 [m, N] and acts: gguf_linear_scratch_bytes(m, K) bytes, shared;
 * *failed is set when a thread could not allocate its scratch. */
void gguf_linear_team(const GgufProjection *p, const uint16_t *x, int64_t x_stride,
                      const uint16_t *bias, uint16_t *out, int64_t m_rows, float *y, void *acts,
                      int *failed) {
    int64_t n = 0;
    for (int i = 0; i < p->num_parts; i++) n += p->parts[i].rows;
#if defined(__AVX512BF16__)
    const int tiles = p->bf16_from_rows > 0 && m_rows >= p->bf16_from_rows;
#else
    const int tiles = 0;
#endif
    Activations a = activations_at(acts, m_rows, p->k);
    int spans = 0;
    for (int i = 0; i < p->num_parts; i++) spans |= spans_for(p->parts[i].type);
    if (!tiles) quantize_rows_team(x, 1, x_stride, m_rows, p->k, &a, spans);
    int ok = 1;
    int64_t column = 0;
    for (int i = 0; i < p->num_parts; i++) {
        const GgufPart *part = &p->parts[i];
#if defined(__AVX512BF16__)
        if (tiles)
            ok &= bf16_tiles_team(part->type, part->blocks, part->row_bytes, part->row_map,
                                  part->rows, p->k, x, x_stride, m_rows, y + column, n, 0);
        else
#endif
            ok &= products_team(part->type, part->blocks, part->row_bytes, part->row_map,
                                part->rows, p->k, &a, m_rows, y + column, n);
        column += part->rows;
    }
    if (!ok) {
#pragma omp atomic write
        *failed = 1;
    }
    const int64_t span = 256;  /* columns per piece of the rounding, shared out */
#pragma omp for schedule(static)
    for (int64_t first = 0; first < n; first += span) {
        const int64_t last = first + span < n ? first + span : n;
        for (int64_t m = 0; m < m_rows; m++)
            for (int64_t j = first; j < last; j++) {
                const float value = y[m * n + j];
                out[m * n + j] = float_to_bf16(bias ? value + bf16_to_float(bias[j]) : value);
            }
    }
}
