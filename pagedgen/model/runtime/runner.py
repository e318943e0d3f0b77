"""ModelRunner: owns the KV cache and runs one forward per engine step (docs/contracts.md §4)."""
from __future__ import annotations

from types import ModuleType

import torch

from pagedgen.kernels import get_ops
from pagedgen.kernels.invariant_attention import InvariantOps
from pagedgen.model.layers.attention import StepMetadata, build_step_metadata
from pagedgen.model.runtime.batch import FlatBatch, ScheduledChunk, build_flat_batch
from pagedgen.model.runtime.cpu_malloc import keep_freed_memory
from pagedgen.model.runtime.kv_cache import allocate_kv_cache, resolve_num_blocks
from pagedgen.model.loading.loader import LoadedModel

__all__ = ["ModelRunner", "ScheduledChunk"]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, block_size: int, num_blocks: int | None = None,
                 kv_memory_bytes: int | None = None, kv_memory_fraction: float | None = None,
                 kernels: ModuleType | None = None, batch_invariant: bool = False) -> None:
        """kernels: override the device's kernel module (tests run triton_ops interpreted on CPU).
        batch_invariant: each row's logits bitwise independent of the rest of the batch and of
        the prefill chunking (row-tiled projections, kernels/invariant_attention.py)."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.model = loaded.model
        self.config = loaded.config
        self.dtype, self.device = loaded.dtype, torch.device(loaded.device)
        self.block_size = block_size
        self.ops = kernels or get_ops(self.device)  # Triton kernels on CUDA, torch ops on CPU
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
        self.batch_invariant = batch_invariant
        if batch_invariant:
            self.ops = InvariantOps(self.ops)
        self.num_blocks = resolve_num_blocks(
            bytes_per_token=self.config.kv_bytes_per_token(self.dtype), block_size=block_size,
            device=self.device, num_blocks=num_blocks, kv_memory_bytes=kv_memory_bytes,
            kv_memory_fraction=kv_memory_fraction)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.model.pack_weights(batch_invariant=batch_invariant)
        self.kv_cache = allocate_kv_cache(self.config.num_layers, self.num_blocks, block_size,
                                          self.config.num_kv_heads, self.config.head_dim,
                                          self.dtype, self.device)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledChunk], copies: list[tuple[int, int]]) -> torch.Tensor:
        """CoW copies first, then one forward; float32 logits [sampled chunks, vocab] in batch order."""
        self._copy_blocks(copies)
        if not batch:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)
        flat = build_flat_batch(batch, self.block_size)
        self._check_ids(flat)
        step = self._step_metadata(flat)
        hidden = self.model(flat.input_ids.to(self.device), step, self.kv_cache)
        rows = flat.sample_rows.to(self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        pairs = torch.tensor(copies, dtype=torch.int64).reshape(-1, 2)
        self._check_block_ids(pairs, "copies")
        pairs = pairs.to(self.device)
        self.ops.copy_blocks(self.kv_cache, pairs[:, 0].contiguous(), pairs[:, 1].contiguous())

    def _step_metadata(self, flat: FlatBatch) -> StepMetadata:
        on_device = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        return build_step_metadata(
            self.ops, slot_mapping=on_device(flat.slot_mapping),
            block_tables=on_device(flat.block_tables), seq_lens=on_device(flat.seq_lens),
            query_start_loc=on_device(flat.query_start_loc),
            rope=self.model.rope.index_select(0, on_device(flat.positions)),
            block_size=self.block_size)

    def _check_ids(self, flat: FlatBatch) -> None:
        """Bad ids would index out of bounds deep in a kernel; name the field instead."""
        self._check_block_ids(flat.block_tables, "block_table")
        vocab = self.config.vocab_size
        if bool(((flat.input_ids < 0) | (flat.input_ids >= vocab)).any()):
            raise ValueError(f"token_ids must be in [0, {vocab}) for this model")
        limit = self.config.max_position_embeddings
        if int(flat.seq_lens.max()) > limit:
            raise ValueError(f"start_pos + len(token_ids) must be <= {limit} "
                             "(the model's max_position_embeddings)")

    def _check_block_ids(self, ids: torch.Tensor, field: str) -> None:
        if bool(((ids < 0) | (ids >= self.num_blocks)).any()):
            raise ValueError(f"{field} holds a block id outside [0, {self.num_blocks})")
