/* Writes the new tokens' K and V rows into their cache slots (the CPU store_kv).
 *
 * Why C: torch's index_copy_ into the [N * B, H_kv, D] cache has a large fixed cost per call at
 * decode sizes (a few dozen rows of a few hundred bytes), paid twice per layer every step.
 * Rows are copied as bytes, so any dtype works; the source rows may be strided (K and V are
 * views of the fused QKV output). Slot -1 skips the token (docs/contracts.md section 2); a
 * slot past the cache fails the whole call before anything is written (returns 1).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "team_ops.h"

/* This thread's share of the rows. The slots are scattered over the cache and their lines are
 * cold: request all of them first so the misses overlap, then copy (bench/FIGURES.md). */
void store_kv_team(const void *key, int64_t key_stride_bytes, const void *value,
                   int64_t value_stride_bytes, void *k_cache, void *v_cache, const int64_t *slots,
                   int64_t rows, int64_t row_bytes) {
    const int me = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t first = rows * me / threads, last = rows * (me + 1) / threads;
    const char *k_src = key, *v_src = value;
    char *k_dst = k_cache, *v_dst = v_cache;
    for (int64_t t = first; t < last; t++) {
        if (slots[t] < 0) continue;
        for (int64_t byte = 0; byte < row_bytes; byte += 64) {
            __builtin_prefetch(k_dst + slots[t] * row_bytes + byte, 1, 3);
            __builtin_prefetch(v_dst + slots[t] * row_bytes + byte, 1, 3);
        }
    }
    for (int64_t t = first; t < last; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_dst + slots[t] * row_bytes, k_src + t * key_stride_bytes, (size_t)row_bytes);
        memcpy(v_dst + slots[t] * row_bytes, v_src + t * value_stride_bytes, (size_t)row_bytes);
    }
#pragma omp barrier
}

/* The Python entry point: one thread (a few dozen rows; a region would cost more than it
 * saves). Returns 1, writing nothing, when a slot is past the cache. */
int store_kv_rows(const void *key, int64_t key_stride_bytes, const void *value,
                  int64_t value_stride_bytes, void *k_cache,
                  void *v_cache, const int64_t *slots, int64_t rows, int64_t row_bytes,
                  int64_t capacity) {
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] >= capacity) return 1;
    store_kv_team(key, key_stride_bytes, value, value_stride_bytes, k_cache, v_cache, slots,
                  rows, row_bytes);
    return 0;
}
