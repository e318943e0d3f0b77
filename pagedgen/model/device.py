"""Which device a model runs on when the user says "auto" (or nothing)."""

from __future__ import annotations

import torch


def resolve_device(device: str | None) -> str:
    """None or "auto": CUDA when available, else CPU; anything else is returned as given."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
