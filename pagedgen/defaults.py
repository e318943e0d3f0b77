"""Defaults shared by the API (llm.py), the run config (config.py) and inspect-memory.

Defined once here so that `LLM()`, `pagedgen run` and `pagedgen inspect-memory` size the same
pool when no size is given.
"""
from __future__ import annotations

# KV pool bytes on CPU when neither kv_memory nor num_blocks is given. A fraction of free memory
# is the GPU habit, but on CPU that meant several GB of zero-filled pool for a small model on a
# machine shared with the OS and other processes; 1 GiB holds ~46k tokens of SmolLM2-135M (bf16).
DEFAULT_KV_MEMORY = 2**30


def default_kv_memory(device_type: str) -> int | None:
    """The pool bytes to use when none are given; None on CUDA (a share of free GPU memory)."""
    return None if device_type == "cuda" else DEFAULT_KV_MEMORY
