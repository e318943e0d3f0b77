"""The engine's view of its config: the settings themselves are pagedgen/settings (the table
and EngineConfig); what is left here is the one rule that needs the loaded model and the pool."""

from __future__ import annotations


def resolve_max_model_len(requested: int | None, max_positions: int, pool_tokens: int) -> int:
    """None: the model's length, capped by what the pool can hold at all. A requested length
    above the pool's capacity is allowed: requests that would not fit fail alone, with a reason."""
    if requested is None:
        return min(max_positions, pool_tokens)
    if requested > max_positions:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's max_position_embeddings "
                         f"({max_positions}); lower --max-model-len")
    return requested
