"""Does a GEMM row's result depend on the other rows? The measurements behind row_tiles.py and
kernels/cpu/invariant_attention.py, for this machine's torch build.

1. bf16 projections (oneDNN, the default model's shapes): each row vs the same row computed
   alone (M=1) and vs a fixed 32-row call with other content around it.
2. float32 matmul (MKL): rows of [M, 64] @ [64, n] against the same rows in a 3-row call.
3. the same products as batched GEMM items of one fixed shape, any batch count / position.

    python bench/check_row_invariance.py --threads 1
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def projections() -> None:
    for n, k in ((1728, 576), (576, 1536), (960, 576)):
        weight = torch.randn(n, k).bfloat16()
        x = torch.randn(600, k).bfloat16()
        alone = F.linear(x[:1], weight)[0]
        changed = [m for m in (2, 3, 8, 16, 33, 64, 128, 256, 512, 600)
                   if not torch.equal(F.linear(x[:m], weight)[0], alone)]
        tile = x[:32].clone()
        other = tile.clone()
        other[1:] = torch.randn(31, k).bfloat16()
        torch.randn(31, k)  # keeps the random stream of the first recorded run
        fixed = torch.equal(F.linear(tile, weight)[0], F.linear(other, weight)[0])
        print(f"bf16 linear {n}x{k}: row 0 differs from M=1 at M in {changed}; "
              f"fixed M=32 with other rows changed: {'same' if fixed else 'DIFFERENT'} bits")


def float32_matmul() -> None:
    q, keys = torch.randn(3, 64), torch.randn(64, 40)
    reference = q @ keys
    changed = []
    for m in (4, 6, 30, 96, 600):
        a = torch.randn(m, 64)
        a[:3] = q
        if not torch.equal((a @ keys)[:3], reference):
            changed.append(m)
    print(f"float32 matmul [M,64]@[64,40]: the first 3 rows differ from M=3 at M in {changed}")
    items = []
    for count in (1, 5, 64, 300):
        a, b = torch.randn(count, 3, 64), torch.randn(count, 64, 40)
        a[-1], b[-1] = q, keys
        items.append(torch.equal(torch.bmm(a, b)[-1], reference))
    print(f"float32 bmm items [3,64]@[64,40], batch 1/5/64/300: same bits {items}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    torch.set_num_threads(parser.parse_args().threads)
    torch.manual_seed(0)
    projections()
    float32_matmul()


if __name__ == "__main__":
    main()
