"""pagedgen: offline batch generation on a paged KV cache.

The public API mirrors vLLM's offline one::

    from pagedgen import LLM, SamplingParams
    llm = LLM()                                   # built-in default model
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

Names are imported lazily so that `import pagedgen.engine.kv_manager` stays torch-free.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pagedgen.llm",
    "SamplingParams": "pagedgen.engine.sampling_params",
    "StructuredOutputsParams": "pagedgen.engine.structured_params",
    "RequestOutput": "pagedgen.engine.outputs",
    "CompletionOutput": "pagedgen.engine.outputs",
    "RequestFailedError": "pagedgen.engine.outputs",
    "BeamSearchParams": "pagedgen.engine.beam_search",
    "BeamSearchOutput": "pagedgen.engine.outputs",
    "TreeNode": "pagedgen.tree",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedgen' has no attribute {name!r}")
