/* How the flash-attention prefill kernels (prefill_attention_avx512.c, prefill_attention_avx2.c)
 * share a chunk out: work items of one kv head's query heads for a block of query rows, and
 * the first step of keys a row reads under a sliding window. */
#ifndef PAGEDGEN_CPU_PREFILL_ITEMS_H
#define PAGEDGEN_CPU_PREFILL_ITEMS_H

#include <stdint.h>

/* Whole groups share each K/V row across their heads; split them only as far as needed for two
 * items per thread (a short chunk with few kv heads would leave threads idle). */
static inline int prefill_heads_per_item(int group, int64_t groups_of_rows, int threads) {
    for (int heads = group; heads > 1; heads--)
        if (group % heads == 0 && groups_of_rows * (group / heads) >= 2 * (int64_t)threads)
            return heads;
    return 1;
}

/* The step (of `keys` keys) holding the first key a row at position pos sees: its window's
 * start, 0 without a window. Later rows start no earlier. */
static inline int64_t prefill_window_first_step(int64_t pos, int window, int keys) {
    return window > 0 && pos >= window ? (pos - window + 1) / keys : 0;
}

#endif
