"""EngineConfig: every engine option in one place, with the defaults LLM() and the run config
share (configs/default.yaml spells them out). Torch-free, so the CLI can read the defaults
without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass

from pagedgen.validation import is_int, require_int


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 256              # vLLM's default
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None     # None: the model's length, capped by the pool (below)
    enable_prefix_caching: bool = True
    seed: int = 0
    block_size: int = 16
    num_blocks: int | None = None        # the pool: num_blocks, kv_memory bytes, or neither
    kv_memory: int | None = None         # (model/runtime/kv_cache.py: size_kv_pool)
    kv_cache_dtype: str = "auto"         # the pool's element format (kernels/kv_quant.py)
    batch_invariant: bool = False        # row-invariant kernels (docs/batch_invariance.md)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            require_int(name, getattr(self, name))
        for name in ("max_model_len", "num_blocks", "kv_memory"):
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name))
        if self.num_blocks is not None and self.kv_memory is not None:
            raise ValueError("give num_blocks or kv_memory, not both")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("enable_prefix_caching must be True or False, "
                             f"got {self.enable_prefix_caching!r}")
        check_step_budget(self.max_num_seqs, self.max_num_batched_tokens)


def check_step_budget(max_num_seqs: int, max_num_batched_tokens: int) -> None:
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
            f"({max_num_seqs}): every running sequence needs one token of the step budget")


def resolve_max_model_len(requested: int | None, max_positions: int, pool_tokens: int) -> int:
    """None: the model's length, capped by what the pool can hold at all. A requested length
    above the pool's capacity is allowed: requests that would not fit fail alone, with a reason."""
    if requested is None:
        return min(max_positions, pool_tokens)
    if requested > max_positions:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's max_position_embeddings "
                         f"({max_positions}); lower --max-model-len")
    return requested
