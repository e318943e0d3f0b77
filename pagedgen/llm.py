"""The Python API, in vLLM's offline shape::

    from pagedgen import LLM, SamplingParams
    llm = LLM()                                          # built-in default model
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

LLM loads the model, sizes the KV pool, and drives the engine until every request is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from pagedgen.engine.beam_search import BeamSearchParams
from pagedgen.engine.builder import build_engine
from pagedgen.engine.engine_config import EngineConfig
from pagedgen.engine.outputs import BeamSearchOutput, RequestOutput, Usage
from pagedgen.engine.sampling_params import SamplingParams
from pagedgen.memory.report import build_report
from pagedgen.memory.tracker import MemoryTracker
from pagedgen.model.device import resolve_device
from pagedgen.model.loading.loader import load_model
from pagedgen.model.runtime.kv_cache import kv_format
from pagedgen.progress import GenerationProgress
from pagedgen.prompts import (Conversation, EncodedPrompt, Prompt, encode_chat, encode_isolated,
                              normalize_prompts, normalize_sampling_params)
from pagedgen.tree import TreeNode, TreeRollouts
from pagedgen.validation import require_int


class LLM:
    """Engine options (all keyword): dtype ("auto"/None: the loader's choice), device
    ("auto"/None: CUDA when available, else CPU), block_size, num_blocks (or num_gpu_blocks,
    vLLM's name) or kv_memory (bytes for the pool; neither: 1 GiB on CPU, a share of free
    memory on CUDA), max_num_seqs, max_num_batched_tokens, max_model_len (default: the model's
    max_position_embeddings capped by the pool's capacity), enable_prefix_caching, seed (for
    unseeded requests), threads (torch.set_num_threads; None leaves torch's choice), tokenizer
    (a folder whose tokenizer replaces the model's own; for a GGUF file it must have the file's
    vocabulary), kv_cache_dtype ("auto": the model's dtype; "int8", "fp8_e4m3", "fp8_e5m2":
    8-bit codes with per-block scales, about half the bytes per token of bf16), batch_invariant
    (each request's output bitwise independent of what shares its batches, of prompt chunking
    and preemption: README "Same answer whatever the batch")."""

    def __init__(self, model: str | None = None, *, dtype: str | torch.dtype | None = None,
                 device: str | None = None, block_size: int = 16, num_blocks: int | None = None,
                 num_gpu_blocks: int | None = None, kv_memory: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 seed: int = 0, threads: int | None = None, tokenizer: str | None = None,
                 kv_cache_dtype: str = "auto", batch_invariant: bool = False) -> None:
        _set_threads(threads)
        # Checked before the (slow) model load, so that a typo fails at once.
        config = EngineConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                              enable_prefix_caching, seed, block_size,
                              _one_block_count(num_blocks, num_gpu_blocks), kv_memory,
                              kv_cache_dtype, batch_invariant)
        kv_format(kv_cache_dtype)  # a bad name fails before the (slow) model load
        self.loaded = load_model(model, None if dtype == "auto" else dtype, resolve_device(device),
                                 tokenizer)
        self.engine = build_engine(self.loaded, config)  # engine.config: max_model_len resolved
        self.runner = self.engine.runner
        self.max_model_len = self.engine.config.max_model_len
        self.tracker = self._build_tracker(block_size)
        self.engine.attach_tracker(self.tracker)
        self._request_counter = 0
        self._tree = TreeRollouts(self)

    def _build_tracker(self, block_size: int) -> MemoryTracker:
        cfg, dtype = self.loaded.config, self.runner.dtype
        return MemoryTracker(block_size, self.runner.num_blocks, self.runner.kv_bytes_per_token,
                             str(dtype).removeprefix("torch."), self.max_model_len,
                             num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim, kv_cache_dtype=self.runner.kv_cache_dtype)

    def get_tokenizer(self) -> Any:
        return self.loaded.tokenizer

    # --- generation ---
    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams |
                 list[SamplingParams] | None = None, use_tqdm: bool = True,
                 on_output: Callable[[RequestOutput], None] | None = None,
                 request_ids: list[str] | None = None) -> list[RequestOutput]:
        """Generates for a string, a token-id list, a {"prompt": ...} / {"prompt_token_ids": ...}
        dict, or a list of any of these. Returns one RequestOutput per prompt, in input order;
        `on_output` sees each one as soon as it finishes (completion order)."""
        items = normalize_prompts(prompts, self.loaded.tokenizer)
        return self._generate(items, sampling_params, use_tqdm, on_output, request_ids)

    def _generate(self, items: list[EncodedPrompt], sampling_params: Any, use_tqdm: bool,
                  on_output: Callable[[RequestOutput], None] | None,
                  request_ids: list[str] | None) -> list[RequestOutput]:
        """Queues every prompt, then runs; a prompt that failed to encode is answered with its
        error and the rest still run."""
        params = normalize_sampling_params(sampling_params, len(items))
        ids = self._request_ids(request_ids, len(items))
        failed = {}
        try:
            for request_id, item, p in zip(ids, items, params):
                if item.error is not None:
                    failed[request_id] = _failed_output(request_id, item)
                    continue
                # A BeamSearchParams entry runs that prompt by beam search (outputs: its beams).
                add = self.engine.add_beam_request if isinstance(p, BeamSearchParams) \
                    else self.engine.add_request
                add(request_id, item.token_ids, p, item.text)
        except BaseException:
            # All or nothing: a call that raises leaves none of its requests queued, or the
            # next generate() would run (and return) them.
            self.engine.abort_all()
            raise
        return self._run(ids, use_tqdm, on_output, failed)

    def chat(self, conversations: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, on_output: Callable[[RequestOutput], None] | None = None,
             request_ids: list[str] | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template (with the generation prompt) and generates."""
        single = bool(conversations) and isinstance(conversations[0], dict)  # one conversation
        batch = [conversations] if single else list(conversations)
        tokenizer = self.loaded.tokenizer
        items = [encode_isolated(lambda c=conversation: encode_chat(tokenizer, c)) for conversation in batch]
        return self._generate(items, sampling_params, use_tqdm, on_output, request_ids)

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search (transformers' semantics, vLLM's shape): one output per prompt with
        `beam_width` beams, best first. All prompts' beams run in the same batches; beams share
        their common blocks and fork / drop them in place (docs/branching.md)."""
        items = normalize_prompts(prompts, self.loaded.tokenizer)
        outputs = self._generate(items, params, use_tqdm, None, None)
        return [BeamSearchOutput.from_request_output(o) for o in outputs]

    # --- tree rollouts (pagedgen/tree.py) ---
    def tree_root(self, prompt: Prompt) -> TreeNode:
        """Computes a prompt's K/V once and returns the root node of a rollout tree."""
        items = normalize_prompts(prompt, self.loaded.tokenizer)
        if len(items) != 1:
            raise ValueError(f"tree_root takes one prompt, got {len(items)}")
        if items[0].error is not None:
            raise ValueError(items[0].error)
        return self._tree.root(items[0].token_ids)

    def extend(self, nodes: TreeNode | list[TreeNode], k: int = 1, max_tokens: int = 16,
               sampling_params: SamplingParams | None = None) -> list[list[TreeNode]]:
        """Extends every node by k branches of up to max_tokens tokens (sampling_params's other
        fields apply; logprobs default to 0). All nodes' branches run in the same engine steps.
        Returns the children of each node, in order; every child holds its blocks until
        `release`."""
        nodes = [nodes] if isinstance(nodes, TreeNode) else list(nodes)
        return self._tree.extend(nodes, k, max_tokens, sampling_params)

    def release(self, nodes: TreeNode | list[TreeNode]) -> None:
        """Drops tree nodes: their block references go at once (shared blocks stay with the
        nodes that still hold them)."""
        self._tree.release(nodes)

    def _request_ids(self, given: list[str] | None, count: int) -> list[str]:
        if given is None:
            start, self._request_counter = self._request_counter, self._request_counter + count
            return [str(i) for i in range(start, start + count)]
        ids = [str(r) for r in given]
        if len(ids) != count:
            raise ValueError(f"request_ids has {len(ids)} entries for {count} prompts")
        if len(set(ids)) != count:
            raise ValueError("request_ids must be unique")
        return ids

    def _run(self, ids: list[str], use_tqdm: bool,
             on_output: Callable[[RequestOutput], None] | None,
             failed: dict[str, RequestOutput] | None = None) -> list[RequestOutput]:
        failed = failed or {}
        done = dict(failed)
        try:
            with GenerationProgress(len(ids), self.runner.num_blocks, use_tqdm) as progress:
                for output in failed.values():
                    if on_output is not None:
                        on_output(output)
                if failed:
                    progress.update(len(failed), self.engine.stats.generated_tokens, 0)
                while self.engine.has_unfinished():
                    finished = self.engine.step()
                    for output in finished:
                        done[output.request_id] = output
                        if on_output is not None:
                            on_output(output)
                    progress.update(len(finished), self.engine.stats.generated_tokens,
                                    self.engine.kv.snapshot().blocks_used)
        except BaseException:
            # An error (or Ctrl-C) mid-run: drop what is left so the next call starts clean.
            self.engine.abort_all()
            raise
        return [done[i] for i in ids]

    # --- reporting ---
    def memory_report(self) -> dict[str, Any]:
        """The memory report (memory/report.py schema) over everything run so far."""
        return build_report(self.tracker, self.engine.kv.counters)

    @property
    def stats(self) -> dict[str, int]:
        """Engine and scheduler counters (steps, tokens, preemptions, recomputed tokens...)."""
        return {**asdict(self.engine.stats), **asdict(self.engine.scheduler.stats)}


def _failed_output(request_id: str, item: EncodedPrompt) -> RequestOutput:
    """The answer of a prompt that could not be encoded (the engine's rejection format)."""
    return RequestOutput(request_id, item.text, [], [], True, Usage(0, 0, 0),
                         f"request {request_id!r}: {item.error}")


def _set_threads(threads: int | None) -> None:
    if threads is None:
        return
    require_int("threads", threads)
    torch.set_num_threads(threads)


def _one_block_count(num_blocks: int | None, num_gpu_blocks: int | None) -> int | None:
    """num_gpu_blocks is vLLM's name for the same count."""
    if num_blocks is not None and num_gpu_blocks is not None and num_blocks != num_gpu_blocks:
        raise ValueError("give num_blocks or num_gpu_blocks, not two different values")
    return num_blocks if num_blocks is not None else num_gpu_blocks
