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

ROWS = 128  # one tile covers a decode step of up to 128 sequences; prefills take several


@dataclass(frozen=True, slots=True)
class RowTiled:
    """Marks a weight for row-tiled projections; `inner` is its usual packing (or None)."""

    inner: object
    rows: int = ROWS
    kind: str = "row_tiled"


def in_row_tiles(project: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 rows: int) -> torch.Tensor:
    """project(x) computed on row tiles of exactly `rows` rows, padded with zero rows."""
    count = x.shape[0]
    padded = -(-max(count, 1) // rows) * rows
    if padded != count:
        x = torch.cat((x, x.new_zeros(padded - count, *x.shape[1:])))
    if padded == rows:
        return project(x)[:count]
    return torch.cat([project(x[begin:begin + rows]) for begin in range(0, padded, rows)])[:count]
