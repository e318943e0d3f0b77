"""The prefix store identity of a built runner: every setting that changes a block's bytes.

Kept out of the store package (which knows no model) and out of the runner (which knows no
store): the builder calls `store_setup` once, after the runner has sized its pool.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from typing import Any

import torch

from pagedgen.kernels.cpu import native
from pagedgen.model.loading.source import ModelSource
from pagedgen.model.runtime.kv_groups import KVGroupLayout

from .prefix_store import BlockStore, StoreIdentity, file_content_digest
from .store_steps import PrefixStoreSetup


def store_setup(prefix_store: str | os.PathLike | BlockStore, source: ModelSource,
                runner: Any) -> PrefixStoreSetup:
    store = prefix_store if isinstance(prefix_store, BlockStore) else BlockStore(prefix_store)
    return PrefixStoreSetup(store, runner_identity(source, runner, store.digests))


def runner_identity(source: ModelSource, runner: Any, digest_cache: Path | None) -> StoreIdentity:
    cfg = runner.config
    layers = (f"{cfg.architecture} layers={cfg.num_layers} kv_heads={cfg.num_kv_heads} "
              f"head_dim={cfg.head_dim} heads={cfg.num_heads} {group_layout(runner.kv_layout)}")
    rope = f"theta={cfg.rope_theta!r} scaling={sorted((cfg.rope_scaling or {}).items())!r}"
    return StoreIdentity(
        model_digest=file_content_digest(model_files(source), digest_cache),
        weights_format=source.kind, dtype=str(runner.dtype).removeprefix("torch."),
        kv_cache_dtype=runner.kv_cache_dtype, block_size=runner.block_size, layers=layers,
        rope=rope, kernel_path=kernel_path(runner), batch_invariant=runner.batch_invariant)


def group_layout(layout: KVGroupLayout) -> str:
    """How a stored block's payload is laid out: its page in each layer group, in group order,
    each page the group's layers by position. One group holds every layer in order, whatever
    its window, so it keeps the text (and the keys) of a full-attention pool; with several
    groups another grouping lays the same K/V out otherwise and must never read these files."""
    if not layout.is_hybrid:
        return "attention=full"
    return (f"attention=groups of {layout.group_size} windows={list(layout.group_windows)} "
            f"layer_group={list(layout.layer_group)} "
            f"layer_position={list(layout.layer_position)}")


def model_files(source: ModelSource) -> list[Path]:
    """The files whose bytes decide the weights: the GGUF file, or config.json and every
    safetensors file of a folder."""
    if source.kind == "gguf":
        return [source.path]
    return [source.path / "config.json", *sorted(source.path.glob("*.safetensors"))]


def kernel_path(runner: Any) -> str:
    """Which code computed the K/V: torch's version, the device, and on CPU the native kernels
    this CPU kind runs (the same operation rounds differently on AMX, AVX-512 BF16 and torch)."""
    device = runner.device
    if device.type != "cpu":
        return f"torch {torch.__version__} {device.type} {torch.cuda.get_device_name(device)}"
    cpu = hashlib.blake2b(_cpu_description().encode(), digest_size=8).hexdigest()
    cfg = runner.config
    attention = native.prefill_attention_path(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) \
        if native.enabled() else "torch sdpa"
    gemm = native.gemm_kind() if native.enabled() else None
    if gemm == "avx512" and native.avx512_linear_form():  # its float32 form rounds otherwise
        gemm += " float32-fma"
    return (f"torch {torch.__version__} cpu {platform.machine()} cpu-id {cpu} "
            f"gemm {gemm} attention {attention} threads {torch.get_num_threads()}")


def _cpu_description() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = text.splitlines()
    pick = lambda prefix: next((l for l in lines if l.startswith(prefix)), "")  # noqa: E731
    return pick("model name") + pick("flags")
