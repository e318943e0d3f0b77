/* The (head_dim, query heads per kv head) pairs the decode-attention kernels compile
 * specialised code for (constant loop bounds: unrolled and vectorised), shared by
 * decode_attention.c and decode_attention_bf16.c; other shapes take a generic path
 * (the portable kernel) or decline (the bf16 kernel). X is called as X(DIM, GROUP).
 * DECODE_SHAPES_256 (Gemma 3's head size) only in the bf16 kernel: the portable one
 * serves head_dim 256 with its generic path, as each of its specialisations costs seconds
 * of the first-use build. */
#ifndef PAGEDGEN_CPU_DECODE_SHAPES_H
#define PAGEDGEN_CPU_DECODE_SHAPES_H

#define DECODE_SHAPES(X) \
    X(64, 1) X(64, 2) X(64, 3) X(64, 4) X(64, 8) X(128, 1) X(128, 2) X(128, 4) X(128, 8)
#define DECODE_SHAPES_256(X) X(256, 1) X(256, 2) X(256, 4)

/* In a pick(dim, group) function: return the specialisation attend_DIM_GROUP that matches. */
#define DECODE_PICK_CASE(DIM, GROUP) \
    if (dim == DIM && group == GROUP) return attend_##DIM##_##GROUP;

#endif
