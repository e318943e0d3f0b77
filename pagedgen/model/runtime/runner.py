"""ModelRunner: owns the KV cache and runs one forward per engine step (docs/contracts.md §4)."""
from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from pagedgen.kernels import get_ops
from pagedgen.settings import EngineConfig
from pagedgen.kernels.cpu.invariant_attention import InvariantOps
from pagedgen.model.layers.attention import StepMetadata, build_step_metadata
from pagedgen.model.runtime.batch import FlatBatch, ScheduledChunk, build_flat_batch
from pagedgen.model.runtime.cpu_malloc import keep_freed_memory
from pagedgen.kernels.kv_quant import copy_block_scales, kv_format
from pagedgen.model.runtime.kv_cache import (allocate_kv_cache, allocate_kv_scales,
                                             kv_bytes_per_token, kv_storage_dtype, size_kv_pool)
from pagedgen.model.runtime.kv_groups import layout_for
from pagedgen.model.runtime.timed_kernels import TimedKernels
from pagedgen.model.runtime import kv_block_bytes
from pagedgen.model.runtime.weight_bytes import gguf_block_bytes
from pagedgen.model.loading.loader import LoadedModel

__all__ = ["ModelRunner", "ScheduledChunk"]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, kernels: ModuleType | None = None,
                 kv_memory_fraction: float | None = None, hybrid_kv: bool = True) -> None:
        """config: the run's settings, already checked (pagedgen/settings); the runner reads the
        pool's (block_size, num_blocks / kv_memory, kv_cache_dtype) and batch_invariant.
        kernels: override the device's kernel module (tests run triton_ops interpreted on CPU).
        kv_memory_fraction: size the pool as this share of free memory (tests; CUDA's default).
        batch_invariant: each row's logits bitwise independent of the rest of the batch and of
        the prefill chunking (row-tiled projections, kernels/cpu/invariant_attention.py).
        hybrid_kv: group layers by attention kind so sliding groups release blocks (kv_groups.py);
        False keeps every token of every layer in one group (the full-attention pool)."""
        self.model = loaded.model
        self.config = loaded.config
        self.dtype, self.device = loaded.dtype, torch.device(loaded.device)
        self.block_size = block_size = config.block_size
        self.kernels = kernels or get_ops(self.device)  # Triton kernels on CUDA, the CPU backend on CPU
        self.kv_cache_dtype = config.kv_cache_dtype
        self.batch_invariant = config.batch_invariant
        if self.batch_invariant:
            self.kernels = InvariantOps(self.kernels)
        self.ops = self.kernels  # what the model calls: the backend, or it seen through a timer
        # Layers grouped by attention kind (kv_groups.py); a page holds G layers' K/V, so the
        # pool is sized and allocated in pages of G layers (G = every layer without windows).
        self.kv_layout = layout_for(self.config, hybrid_kv)
        self.group_windows = self.kv_layout.group_windows
        group_size = self.kv_layout.group_size
        self.kv_bytes_per_token = kv_bytes_per_token(
            group_size, self.config.num_kv_heads, self.config.head_dim, self.dtype,
            self.kv_cache_dtype, block_size)
        # Every layer keeping every token: the counterfactual the memory report shows.
        self.full_attention_bytes_per_token = self.config.kv_bytes_per_token(
            self.dtype, self.kv_cache_dtype, block_size)
        if self.device.type == "cpu":
            keep_freed_memory()
        # Weights first: the copies our kernels read are then resident when free memory is
        # read, and what stays mapped from a GGUF file (resident only once the first steps
        # touch it) is set aside.
        self.model.pack_weights(batch_invariant=self.batch_invariant)
        self.num_blocks = size_kv_pool(
            bytes_per_token=self.kv_bytes_per_token, block_size=block_size,
            device=self.device, num_blocks=config.num_blocks, kv_memory_bytes=config.kv_memory,
            kv_memory_fraction=kv_memory_fraction,
            reserved_bytes=self._mapped_weight_bytes()).num_blocks
        self.kv_cache = allocate_kv_cache(group_size, self.num_blocks, block_size,
                                          self.config.num_kv_heads, self.config.head_dim,
                                          kv_storage_dtype(self.dtype, self.kv_cache_dtype),
                                          self.device)
        self.kv_scales = None  # float32 [G, 2, N, H_kv] beside a quantized pool
        if kv_format(self.kv_cache_dtype) is not None:
            self.kv_scales = allocate_kv_scales(group_size, self.num_blocks,
                                                self.config.num_kv_heads, self.device)

    def _mapped_weight_bytes(self) -> int:
        """A mapped file's blocks count against host memory only."""
        return gguf_block_bytes(self.model) if self.device.type == "cpu" else 0

    def set_phase_hook(self, hook: Any) -> None:
        """Time the attention kernels inside `hook.phase("attention")`; None: call them directly."""
        self.ops = self.kernels if hook is None else TimedKernels(self.kernels, hook)

    @property
    def kv_cache_bytes(self) -> int:
        scales = self.kv_scales
        scale_bytes = 0 if scales is None else scales.numel() * scales.element_size()
        return self.kv_cache.numel() * self.kv_cache.element_size() + scale_bytes

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
        self.prompt_hidden = _prompt_hidden(batch, flat, hidden)
        rows = flat.sample_rows.to(self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden-state rows (prompt logprobs compute them a slice at a time)."""
        return self.model.compute_logits(hidden)

    prompt_hidden: list[torch.Tensor] = []  # of the last step's prompt_logprobs chunks

    # --- whole blocks as bytes, for the prefix store on disk (kv_block_bytes.py) ---
    # A stored block is its page in every layer group; block_pages: per block, its page id
    # (one group) or its page id in each group (negative: not loaded).
    @property
    def block_payload_size(self) -> int:
        return kv_block_bytes.block_payload_size(self.kv_cache, self.kv_scales,
                                                 self.kv_layout.num_groups)

    def read_blocks(self, block_pages: kv_block_bytes.BlockPages) -> Any:
        return kv_block_bytes.read_blocks(self.kv_cache, self.kv_scales, block_pages)

    def write_blocks(self, block_pages: kv_block_bytes.BlockPages,
                     payloads: list[memoryview]) -> None:
        kv_block_bytes.write_blocks(self.kv_cache, self.kv_scales, block_pages, payloads)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        pairs = torch.tensor(copies, dtype=torch.int64).reshape(-1, 2)
        self._check_block_ids(pairs, "copies")
        pairs = pairs.to(self.device)
        src, dst = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
        self.ops.copy_blocks(self.kv_cache, src, dst)
        if self.kv_scales is not None:  # a block's scales travel with it
            copy_block_scales(self.kv_scales, src, dst)

    def _step_metadata(self, flat: FlatBatch) -> StepMetadata:
        on_device = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        seq_lens, query_start_loc = on_device(flat.seq_lens), on_device(flat.query_start_loc)
        rope = self.model.rope.index_select(0, on_device(flat.positions))
        windows = self.group_windows

        def for_group(slots: torch.Tensor, tables: torch.Tensor) -> StepMetadata:
            return build_step_metadata(
                self.ops, slot_mapping=on_device(slots), block_tables=on_device(tables),
                seq_lens=seq_lens, query_start_loc=query_start_loc, rope=rope,
                block_size=self.block_size, kv_scales=self.kv_scales)

        if flat.group_block_tables is None:
            if len(windows) > 1:
                raise ValueError("this model's KV cache has layer groups: every ScheduledChunk "
                                 "needs group_tables")
            return for_group(flat.slot_mapping, flat.block_tables)
        # Each group's layers read their window's plan from their group's metadata.
        groups = tuple(for_group(slots, tables) for slots, tables in
                       zip(flat.group_slot_mapping, flat.group_block_tables))
        step = groups[0]
        step.group_steps = groups
        step.layer_slots = tuple(zip(self.kv_layout.layer_group, self.kv_layout.layer_position))
        return step

    def _check_ids(self, flat: FlatBatch) -> None:
        """Bad ids would index out of bounds deep in a kernel; name the field instead."""
        self._check_block_ids(flat.block_tables, "block_table")
        if flat.group_block_tables is not None:
            self._check_block_ids(flat.group_block_tables, "group_tables")
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


def _prompt_hidden(batch: list[ScheduledChunk], flat: FlatBatch,
                   hidden: torch.Tensor) -> list[torch.Tensor]:
    """Hidden states of every token of the chunks that asked for prompt logprobs, in batch
    order. Kept instead of their logits: [tokens, hidden] is small, [tokens, vocab] is not."""
    if not any(c.prompt_logprobs for c in batch):
        return []
    starts = flat.query_start_loc.tolist()
    return [hidden[starts[i]:starts[i + 1]] for i, c in enumerate(batch) if c.prompt_logprobs]
