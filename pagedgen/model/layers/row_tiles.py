"""Projections whose every row gets the same bits whatever the number of rows.

A GEMM library chooses its kernel, blocking and reduction order from the shape, so a row's
result can change with how many rows share the call (measured here: oneDNN bf16 gives M=1
other bits than M>=2 for some shapes; the AMX kernel serves up to 256 rows and F.linear
above). Running every projection on tiles of exactly ROWS rows (the last one zero-padded)
gives every call the same shape, hence the same code path, for every batch; rows inside
one call do not interact (each output row is its own dot products).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ROWS = 16  # the AMX kernel's row block; a trade-off measured in docs/batch_invariance.md


@dataclass(frozen=True, slots=True)
class RowTiled:
    """Marks a weight for row-tiled projections; `inner` is its usual packing (or None)."""

    inner: object
    rows: int = ROWS
    kind: str = "row_tiled"


def in_row_tiles(project: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 rows: int) -> torch.Tensor:
    """project(x) computed on row tiles of exactly `rows` rows, the last one zero-padded."""
    count = x.shape[0]
    if count == rows:
        return project(x)
    if count < rows:
        return project(_zero_padded(x, rows))[:count]
    whole = count // rows * rows
    first = project(x[:rows])
    out = first.new_empty(count, *first.shape[1:])
    out[:rows] = first
    for begin in range(rows, whole, rows):
        out[begin:begin + rows] = project(x[begin:begin + rows])
    if whole < count:
        out[whole:] = project(_zero_padded(x[whole:], rows))[:count - whole]
    return out


def _zero_padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    padded = x.new_zeros(rows, *x.shape[1:])
    padded[:x.shape[0]] = x
    return padded
