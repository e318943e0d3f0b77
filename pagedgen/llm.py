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

import threading

import torch

from pagedgen.engine.beam_search import BeamSearchParams
from pagedgen.engine.builder import build_engine
from pagedgen.engine.outputs import BeamSearchOutput, RequestOutput, Usage
from pagedgen.engine.sampling_params import SamplingParams
from pagedgen.memory.report import build_report
from pagedgen.memory.tracker import MemoryTracker
from pagedgen.model.device import resolve_device
from pagedgen.model.loading.loader import load_model
from pagedgen.model.runtime.weight_bytes import weight_bytes
from pagedgen.progress import GenerationProgress, RunTotals, loading_status, work_left
from pagedgen.prompts import (Conversation, EncodedPrompt, Prompt, encode_conversations,
                              normalize_conversations, normalize_prompts, normalize_sampling_params)
from pagedgen.tree import TreeNode, TreeRollouts
from pagedgen.settings import EngineConfig


class LLM:
    """LLM(model, **settings): model is an HF folder, a .gguf file or None (the built-in
    default); every other setting is a keyword of the settings table (pagedgen/settings/table.py
    holds each one's default, bounds and help; `pagedgen run --help` shows them): dtype, device,
    weights, threads, tokenizer, block_size, num_blocks (or num_gpu_blocks, vLLM's name) or
    kv_memory, kv_cache_dtype, max_num_seqs, max_num_batched_tokens, max_model_len,
    enable_prefix_caching, seed, batch_invariant. An unknown name is a TypeError that suggests
    the closest one; a bad value is a ValueError naming the setting, both before the model loads.
    show_progress=False silences the line printed while the model loads.

    Thread-safe by serializing: calls from several threads on one LLM run one after the other
    (a lock around each generate / chat / beam_search / tree call), so each gets exactly its
    own outputs; for parallel throughput put all prompts in one call (they share batches)."""

    def __init__(self, model: str | None = None, *, show_progress: bool = True,
                 **settings: Any) -> None:
        config = EngineConfig.of(model=model, **settings)
        _set_threads(config.threads)
        run_device = resolve_device(config.device)
        with loading_status(_model_description(config.model), str(run_device), show_progress):
            self.loaded = load_model(config.model, None if config.dtype == "auto" else config.dtype,
                                     run_device, config.tokenizer, weights=config.weights)
        self.engine = build_engine(self.loaded, config)  # engine.config: max_model_len resolved
        self.runner = self.engine.runner
        self.max_model_len = self.engine.config.max_model_len
        self.tracker = self._build_tracker(config.block_size)
        self.engine.attach_tracker(self.tracker)
        self._request_counter = 0
        self._tree = TreeRollouts(self)
        # One engine, one caller at a time: generate / chat / beam_search / tree calls from
        # several threads are served one after the other (each call runs whole), never mixed
        # in one engine loop, where a thread would collect (and lose) another's outputs.
        self._calls = threading.RLock()
        self.last_run: RunTotals | None = None   # the last generate(): wall, tok/s, KV peak

    def _build_tracker(self, block_size: int) -> MemoryTracker:
        cfg, dtype = self.loaded.config, self.runner.dtype
        return MemoryTracker(block_size, self.runner.num_blocks, self.runner.kv_bytes_per_token,
                             str(dtype).removeprefix("torch."), self.max_model_len,
                             num_layers=self.runner.kv_layout.group_size,
                             num_kv_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim, kv_cache_dtype=self.runner.kv_cache_dtype,
                             **self._group_fields())

    def _group_fields(self) -> dict[str, Any]:
        """A hybrid pool's groups for the tracker: pages of G layers, one row per group."""
        layout = self.runner.kv_layout
        if not layout.is_hybrid:
            return {}
        return {"group_windows": layout.group_windows,
                "group_layers": tuple(len(layout.group_layers(g))
                                      for g in range(layout.num_groups)),
                "full_attention_bytes_per_token": self.runner.full_attention_bytes_per_token}

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
        error and the rest still run. Serialized: concurrent callers wait their turn."""
        with self._calls:
            return self._generate_locked(items, sampling_params, use_tqdm, on_output, request_ids)

    def _generate_locked(self, items: list[EncodedPrompt], sampling_params: Any, use_tqdm: bool,
                         on_output: Callable[[RequestOutput], None] | None,
                         request_ids: list[str] | None) -> list[RequestOutput]:
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
        tokenizer = self.loaded.tokenizer
        items = encode_conversations(tokenizer, normalize_conversations(conversations))
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
        with self._calls:
            return self._tree.root(items[0].token_ids)

    def extend(self, nodes: TreeNode | list[TreeNode], k: int = 1, max_tokens: int = 16,
               sampling_params: SamplingParams | None = None) -> list[list[TreeNode]]:
        """Extends every node by k branches of up to max_tokens tokens (sampling_params's other
        fields apply; logprobs default to 0). All nodes' branches run in the same engine steps.
        Returns the children of each node, in order; every child holds its blocks until
        `release`."""
        nodes = [nodes] if isinstance(nodes, TreeNode) else list(nodes)
        with self._calls:
            return self._tree.extend(nodes, k, max_tokens, sampling_params)

    def release(self, nodes: TreeNode | list[TreeNode]) -> None:
        """Drops tree nodes: their block references go at once (shared blocks stay with the
        nodes that still hold them)."""
        with self._calls:
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
        engine = self.engine
        progress = GenerationProgress(len(ids), self.runner.num_blocks, use_tqdm)
        # Engine counters run over the LLM's life; the display counts this call only.
        generated0 = engine.stats.generated_tokens
        prompt0 = engine.scheduler.stats.prompt_tokens_computed
        try:
            with progress:
                for output in failed.values():
                    if on_output is not None:
                        on_output(output)
                progress.finished(list(failed.values()))
                while engine.has_unfinished():
                    finished = engine.step()
                    for output in finished:
                        done[output.request_id] = output
                        if on_output is not None:
                            on_output(output)
                    progress.finished(finished)
                    progress.step(engine.stats.generated_tokens - generated0,
                                  engine.scheduler.stats.prompt_tokens_computed - prompt0,
                                  engine.kv.snapshot().blocks_used,
                                  lambda: work_left(engine, progress.stopped, progress.capped))
        except BaseException:
            # An error (or Ctrl-C) mid-run: drop what is left so the next call starts clean.
            self.engine.abort_all()
            raise
        finally:
            self.last_run = progress.totals
            # Blocks computed so far reach the disk before the call returns (or a killed run
            # exits), so a rerun or --resume finds them; the steps themselves never waited.
            if self.engine.store is not None:
                self.engine.store.flush()
        return [done[i] for i in ids]

    # --- reporting ---
    def memory_report(self) -> dict[str, Any]:
        """The memory report (memory/report.py schema) over everything run so far; with a prefix
        store, its "prefix_store" section: hits, bytes read and written, prefill time saved; and
        what the weights hold in memory (model/runtime/weight_bytes.py)."""
        report = build_report(self.tracker, self.engine.kv.counters)
        if self.last_run is not None:
            report["last_run"] = self.last_run.as_dict()
        if self.engine.store is not None:
            report["prefix_store"] = asdict(self.engine.store.report())
        packed = self.runner.model.gguf_packed is not None
        report["weights"] = {"held_as": "packed" if packed else "dense",
                             "dtype": str(self.runner.dtype).removeprefix("torch."),
                             **weight_bytes(self.runner.model).as_dict()}
        return report

    @property
    def stats(self) -> dict[str, int]:
        """Engine and scheduler counters (steps, tokens, preemptions, recomputed tokens...)."""
        return {**asdict(self.engine.stats), **asdict(self.engine.scheduler.stats)}


def _model_description(model: str | None) -> str:
    """What the load line names: the file, its size and format (or the path as given)."""
    from pagedgen.model.loading.source import locate_model
    from pagedgen.progress import describe_model_file

    try:
        source = locate_model(model)
    except (OSError, ValueError):  # the loader itself reports the problem, with its reason
        return str(model)
    return describe_model_file(source.path, source.kind)


def _failed_output(request_id: str, item: EncodedPrompt) -> RequestOutput:
    """The answer of a prompt that could not be encoded (the engine's rejection format)."""
    return RequestOutput(request_id, item.text, [], [], True, Usage(0, 0, 0),
                         f"request {request_id!r}: {item.error}")


def _set_threads(threads: int | None) -> None:
    if threads is not None:  # None leaves torch's choice
        torch.set_num_threads(threads)
