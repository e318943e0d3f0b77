"""Model runtime: weight loading (HF safetensors folders, GGUF), the Llama-family decoder over
a flat token batch, the paged KV cache and the runner (docs/contracts.md section 4).

Names are imported lazily so that `pagedgen.model.runtime.kv_cache` (sizing arithmetic for
inspect-memory) does not pull in transformers.
"""

_LAZY = {
    "load_model": "pagedgen.model.loading.loader",
    "LoadedModel": "pagedgen.model.loading.loader",
    "ModelConfig": "pagedgen.model.config",
    "ModelRunner": "pagedgen.model.runtime.runner",
    "ScheduledChunk": "pagedgen.model.runtime.batch",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedgen.model' has no attribute {name!r}")
