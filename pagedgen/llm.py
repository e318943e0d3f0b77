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

from pagedgen.validation import require_int
from pagedgen.defaults import default_kv_memory
from pagedgen.engine.engine import EngineConfig, LLMEngine
from pagedgen.memory.report import build_report
from pagedgen.memory.tracker import MemoryTracker
from pagedgen.model.loading.loader import load_model
from pagedgen.model.runtime.runner import ModelRunner
from pagedgen.engine.outputs import RequestOutput
from pagedgen.progress import GenerationProgress
from pagedgen.prompts import (Conversation, Prompt, encode_chat, normalize_prompts,
                              normalize_sampling_params)
from pagedgen.engine.sampling_params import SamplingParams


class LLM:
    """Engine options (all keyword): dtype ("auto"/None: the loader's choice), device
    ("auto"/None: CUDA when available, else CPU), block_size, num_blocks (or num_gpu_blocks,
    vLLM's name) or kv_memory (bytes for the pool; neither: 1 GiB on CPU, a share of free
    memory on CUDA), max_num_seqs, max_num_batched_tokens, max_model_len (default: the model's
    max_position_embeddings capped by the pool's capacity), enable_prefix_caching, seed (for
    unseeded requests), threads (torch.set_num_threads; None leaves torch's choice),
    batch_invariant (each request's output bitwise independent of what shares its batches,
    of prompt chunking and preemption: README "Same answer whatever the batch")."""

    def __init__(self, model: str | None = None, *, dtype: str | torch.dtype | None = None,
                 device: str | None = None, block_size: int = 16, num_blocks: int | None = None,
                 num_gpu_blocks: int | None = None, kv_memory: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 seed: int = 0, threads: int | None = None, batch_invariant: bool = False) -> None:
        _set_threads(threads)
        require_int("block_size", block_size)
        # Checked before the (slow) model load, so that a typo fails at once.
        EngineConfig(max_num_seqs, max_num_batched_tokens, 1, enable_prefix_caching, seed)
        device = _resolve_device(device)
        num_blocks, kv_memory = _pool_size(num_blocks, num_gpu_blocks, kv_memory, device)
        self.loaded = load_model(model, None if dtype == "auto" else dtype, device)
        self.runner = ModelRunner(self.loaded, block_size, num_blocks=num_blocks,
                                  kv_memory_bytes=kv_memory, batch_invariant=batch_invariant)
        self.max_model_len = _resolve_max_model_len(
            max_model_len, self.loaded.config.max_position_embeddings, self.runner.num_blocks * block_size)
        config = EngineConfig(max_num_seqs, max_num_batched_tokens, self.max_model_len,
                              enable_prefix_caching, seed)
        self.tracker = self._build_tracker(block_size)
        self.engine = LLMEngine(self.runner, self.loaded.tokenizer, self.loaded.eos_token_ids, config,
                                self.tracker, hash_extra_key=self.loaded.name)
        self._request_counter = 0

    def _build_tracker(self, block_size: int) -> MemoryTracker:
        cfg, dtype = self.loaded.config, self.runner.dtype
        return MemoryTracker(block_size, self.runner.num_blocks, cfg.kv_bytes_per_token(dtype),
                             str(dtype).removeprefix("torch."), self.max_model_len,
                             num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim)

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
        params = normalize_sampling_params(sampling_params, len(items))
        ids = self._request_ids(request_ids, len(items))
        for request_id, (text, token_ids), p in zip(ids, items, params):
            self.engine.add_request(request_id, token_ids, p, text)
        return self._run(ids, use_tqdm, on_output)

    def chat(self, conversations: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, on_output: Callable[[RequestOutput], None] | None = None,
             request_ids: list[str] | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template (with the generation prompt) and generates."""
        single = bool(conversations) and isinstance(conversations[0], dict)  # one conversation
        batch = [conversations] if single else list(conversations)
        prompts = []
        for conversation in batch:
            text, ids = encode_chat(self.loaded.tokenizer, conversation)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, on_output, request_ids)

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
             on_output: Callable[[RequestOutput], None] | None) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        try:
            with GenerationProgress(len(ids), self.runner.num_blocks, use_tqdm) as progress:
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


def _set_threads(threads: int | None) -> None:
    if threads is None:
        return
    require_int("threads", threads)
    torch.set_num_threads(threads)


def _resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _pool_size(num_blocks: int | None, num_gpu_blocks: int | None, kv_memory: int | None,
               device: str) -> tuple[int | None, int | None]:
    """(num_blocks, kv_memory bytes) for the runner; the shared default when neither is given."""
    if num_blocks is not None and num_gpu_blocks is not None and num_blocks != num_gpu_blocks:
        raise ValueError("give num_blocks or num_gpu_blocks, not two different values")
    num_blocks = num_blocks if num_blocks is not None else num_gpu_blocks
    if num_blocks is None and kv_memory is None:
        kv_memory = default_kv_memory(torch.device(device).type)
    return num_blocks, kv_memory


def _resolve_max_model_len(requested: int | None, max_positions: int, pool_tokens: int) -> int:
    if requested is None:
        return min(max_positions, pool_tokens)
    require_int("max_model_len", requested)
    if requested > max_positions:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's max_position_embeddings "
                         f"({max_positions}); lower --max-model-len")
    # Above the pool's capacity is allowed: requests that would not fit fail alone, with a reason.
    return requested
