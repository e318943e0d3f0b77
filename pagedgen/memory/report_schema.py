"""Checks a memory report read from disk before `inspect-memory` uses any of it.

A report may have been hand-edited or cut short. Every field the pool map and the token
address read is checked here for type and range, so that a bad file gives one ValueError
naming the field (as a path like `peak_block_tables.sequences[3].block_table[7]`) instead of a
KeyError, an IndexError, a negative byte offset shown as if valid, or a pool of 10^10 blocks
allocated before anything is printed.
"""
from __future__ import annotations

from typing import Any

from pagedgen.validation import is_int

# Far above any pool pagedgen sizes (a 1 GiB pool of the tiniest test model at block size 1
# is ~2M blocks), low enough that the per-block map of a hand-edited report stays small.
MAX_BLOCKS = 1 << 22
MAX_BLOCK_SIZE = 1 << 16
MAX_LAYOUT = {"num_layers": 4096, "num_kv_heads": 4096, "head_dim": 1 << 16, "dtype_bytes": 16}


def validate_report(report: Any, source: str) -> dict[str, Any]:
    """`report` unchanged when every field inspect-memory reads is sound; else ValueError
    "<source>: field <path> <what is wrong>"."""
    try:
        _check_report(report)
    except _FieldError as error:
        raise ValueError(f"{source}: field {error.path} {error.reason}") from None
    return report


class _FieldError(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


def _shown(value: Any) -> str:
    """A short picture of a value: a hand-edited file may hold anything, of any size."""
    text = repr(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _mapping(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _FieldError(path, f"must be an object, got {_shown(value)}")
    return value


def _list(value: Any, path: str, max_len: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise _FieldError(path, f"must be a list, got {_shown(value)}")
    if max_len is not None and len(value) > max_len:
        raise _FieldError(path, f"has {len(value)} entries, more than the {max_len} possible")
    return value


def _int(container: dict[str, Any], key: str, path: str, low: int, high: int | None = None) -> int:
    if key not in container:
        raise _FieldError(f"{path}.{key}", "is missing")
    return _int_value(container[key], f"{path}.{key}", low, high)


def _int_value(value: Any, path: str, low: int, high: int | None = None) -> int:
    if not is_int(value):
        raise _FieldError(path, f"must be an integer, got {_shown(value)}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise _FieldError(path, f"must be {bound}, got {_shown(value)}")
    return value


def _check_report(report: Any) -> None:
    report = _mapping(report, "(top level)")
    pool = _mapping(report.get("pool"), "pool")
    num_blocks = _int(pool, "num_blocks", "pool", 1, MAX_BLOCKS)
    block_size = _int(pool, "block_size", "pool", 1, MAX_BLOCK_SIZE)
    if pool.get("layout") is not None:
        layout = _mapping(pool["layout"], "pool.layout")
        for key, high in MAX_LAYOUT.items():
            _int(layout, key, "pool.layout", 1, high)
    if report.get("peak_block_tables") is not None:
        _check_tables(report["peak_block_tables"], "peak_block_tables", num_blocks, block_size)
    snapshots = _list(report.get("block_table_snapshots", []), "block_table_snapshots")
    for i, tables in enumerate(snapshots):
        _check_tables(tables, f"block_table_snapshots[{i}]", num_blocks, block_size)


def _check_tables(tables: Any, path: str, num_blocks: int, block_size: int) -> None:
    tables = _mapping(tables, path)
    _int(tables, "step", path, 0)
    cached = tables.get("cached_free_blocks")
    if cached is None:
        sample = _mapping(tables.get("sample"), f"{path}.sample")
        _int(sample, "blocks_cached_free", f"{path}.sample", 0, num_blocks)
    else:
        for j, block in enumerate(_list(cached, f"{path}.cached_free_blocks", num_blocks)):
            _int_value(block, f"{path}.cached_free_blocks[{j}]", 0, num_blocks - 1)
    for k, seq in enumerate(_list(tables.get("sequences"), f"{path}.sequences")):
        _check_sequence(seq, f"{path}.sequences[{k}]", num_blocks, block_size)


def _check_sequence(seq: Any, path: str, num_blocks: int, block_size: int) -> None:
    seq = _mapping(seq, path)
    _int(seq, "seq_id", path, 0)
    if not isinstance(seq.get("request_id"), (str, type(None))):
        raise _FieldError(f"{path}.request_id", f"must be a string or null, got {_shown(seq.get('request_id'))}")
    if seq.get("sample_index") is not None:
        _int(seq, "sample_index", path, 0)
    table = _list(seq.get("block_table"), f"{path}.block_table", num_blocks)
    for j, block in enumerate(table):
        _int_value(block, f"{path}.block_table[{j}]", 0, num_blocks - 1)
    refs = _list(seq.get("ref_counts"), f"{path}.ref_counts")
    if len(refs) != len(table):
        raise _FieldError(f"{path}.ref_counts", f"has {len(refs)} entries for a block_table of {len(table)}")
    for j, ref in enumerate(refs):
        _int_value(ref, f"{path}.ref_counts[{j}]", 1)
    if seq.get("num_tokens") is not None:
        _int(seq, "num_tokens", path, 0, len(table) * block_size)
