"""Builds an engine from a loaded model and one EngineConfig: the model runner (which sizes and
allocates the KV pool), then the engine, which makes its KV manager and scheduler from the
runner's pool. The facade calls this instead of wiring the three owners itself."""

from __future__ import annotations

from dataclasses import replace

from pagedgen.engine.engine_config import EngineConfig, resolve_max_model_len
from pagedgen.engine.engine import LLMEngine
from pagedgen.model.loading.loader import LoadedModel
from pagedgen.model.runtime.runner import ModelRunner


def build_engine(loaded: LoadedModel, config: EngineConfig) -> LLMEngine:
    """The engine's config is `config` with max_model_len resolved (engine_config.py)."""
    runner = ModelRunner(loaded, config.block_size, num_blocks=config.num_blocks,
                         kv_memory_bytes=config.kv_memory, kv_cache_dtype=config.kv_cache_dtype,
                         batch_invariant=config.batch_invariant)
    max_model_len = resolve_max_model_len(config.max_model_len, loaded.config.max_position_embeddings,
                                          runner.num_blocks * config.block_size)
    return LLMEngine(runner, loaded.tokenizer, loaded.eos_token_ids,
                     replace(config, max_model_len=max_model_len), hash_extra_key=loaded.name)
