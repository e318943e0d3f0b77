"""What the engine tells the memory tracker about one running sequence."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SeqMemInfo:
    """One running sequence at the end of a step (contract section 6)."""
    seq_id: int
    request_id: str
    sample_index: int
    num_tokens: int          # tokens covered by its block table
    prompt_tokens: int
    max_tokens: int          # its request's max_tokens (prompt + max_tokens = static reservation)
