"""Builds an engine from a loaded model and one EngineConfig: the model runner (which sizes and
allocates the KV pool), then the engine, which makes its KV manager and scheduler from the
runner's pool. The facade calls this instead of wiring the three owners itself."""

from __future__ import annotations

import warnings
from dataclasses import replace

from pagedgen.engine.engine_config import resolve_max_model_len
from pagedgen.settings import EngineConfig
from pagedgen.engine.engine import LLMEngine
from pagedgen.model.loading.loader import LoadedModel
from pagedgen.model.loading.source import locate_model
from pagedgen.model.runtime.kv_groups import longest_sequence
from pagedgen.model.runtime.runner import ModelRunner
from pagedgen.engine.prefix_store.store import BlockStore, StoreWarning, UnsafeStoreError
from pagedgen.engine.store_identity import store_setup


def build_engine(loaded: LoadedModel, config: EngineConfig) -> LLMEngine:
    """The engine's config is `config` with max_model_len resolved (engine_config.py)."""
    runner = ModelRunner(loaded, config)
    positions = loaded.config.max_position_embeddings
    # What the pool holds for one sequence: more than its tokens when sliding groups keep
    # only their windows (model/runtime/kv_groups.py).
    pool_tokens = longest_sequence(runner.group_windows, runner.num_blocks, config.block_size,
                                   config.max_num_batched_tokens, positions)
    max_model_len = resolve_max_model_len(config.max_model_len, positions, pool_tokens)
    setup = None if config.prefix_store is None else _store_or_warning(config, runner)
    return LLMEngine(runner, loaded.tokenizer, loaded.eos_token_ids,
                     replace(config, max_model_len=max_model_len), hash_extra_key=loaded.name,
                     prefix_store=setup)


def _store_or_warning(config: EngineConfig, runner: ModelRunner):
    """The prefix store on disk (docs/prefix_store.md). A folder others can write to is refused
    (UnsafeStoreError); one that cannot be opened at all is a warning, and the run goes on."""
    if not config.enable_prefix_caching:
        raise ValueError("prefix_store needs prefix caching on (enable_prefix_caching=True)")
    try:
        store = BlockStore(config.prefix_store, max_bytes=config.prefix_store_max_size,
                           min_free_bytes=config.prefix_store_min_free)
        return store_setup(store, locate_model(config.model), runner)
    except UnsafeStoreError:
        raise
    except OSError as error:
        warnings.warn(f"prefix store {config.prefix_store}: {error}; running without it",
                      StoreWarning, stacklevel=3)
        return None
