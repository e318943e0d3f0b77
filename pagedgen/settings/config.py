"""EngineConfig: the values of every LLM() setting of the table, checked and normalised.

Built by keyword (`EngineConfig.of(**settings)`, what LLM(model, **settings) calls): an unknown
name is a TypeError that suggests the closest setting. Every field is checked by its table entry
when the config is made, then the rules that tie two settings together. Torch-free, so the CLI
reads it without loading the engine; the runner and the engine take it whole.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedgen.settings.table import ALIASES, LLM_SETTINGS, SETTINGS, default, did_you_mean
from pagedgen.validation import brief


class SettingError(ValueError):
    """A setting's value is wrong; the message names the setting, the rule and the value."""


def checked(name: str, value: Any) -> Any:
    """`value` normalised by the table entry `name`, or SettingError naming it."""
    try:
        return SETTINGS[name].check(value)
    except ValueError as exc:
        raise SettingError(f"{name} {exc}, got {brief(value)}") from None


@dataclass(slots=True)
class EngineConfig:
    model: str | None = default("model")
    tokenizer: str | None = default("tokenizer")
    dtype: str = default("dtype")
    device: str = default("device")
    weights: str = default("weights")
    threads: int | None = default("threads")
    block_size: int = default("block_size")
    num_blocks: int | None = default("num_blocks")
    kv_memory: int | None = default("kv_memory")
    kv_cache_dtype: str = default("kv_cache_dtype")
    max_num_seqs: int = default("max_num_seqs")
    max_num_batched_tokens: int = default("max_num_batched_tokens")
    max_model_len: int | None = default("max_model_len")  # the engine's copy holds it resolved
    enable_prefix_caching: bool = default("enable_prefix_caching")
    seed: int = default("seed")
    batch_invariant: bool = default("batch_invariant")
    prefix_store: str | None = default("prefix_store")
    prefix_store_max_size: int = default("prefix_store_max_size")
    prefix_store_min_free: int = default("prefix_store_min_free")

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def of(cls, **settings: Any) -> EngineConfig:
        """From LLM() keywords: table names and their aliases (num_gpu_blocks)."""
        return cls(**_canonical_names(settings))

    def validate(self) -> None:
        """Each field by its table entry, then the rules between settings."""
        for setting in LLM_SETTINGS:
            setattr(self, setting.name, checked(setting.name, getattr(self, setting.name)))
        check_combination(self)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_combination(config: EngineConfig) -> None:
    """The rules that tie settings together; each message names both."""
    if config.num_blocks is not None and config.kv_memory is not None:
        raise SettingError("give num_blocks or kv_memory, not both")
    check_step_budget(config.max_num_seqs, config.max_num_batched_tokens)
    if config.batch_invariant and config.kv_cache_dtype != "auto":
        # The per-row attention reads bf16/float32 pools only.
        raise SettingError("batch_invariant=True needs kv_cache_dtype='auto'")


def check_step_budget(max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """Also the scheduler's own invariant (it calls this): a running sequence that got no token
    of the step's budget would never advance."""
    if max_num_batched_tokens < max_num_seqs:
        raise SettingError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
            f"({max_num_seqs}): every running sequence needs one token of the step budget")


def _canonical_names(settings: dict[str, Any]) -> dict[str, Any]:
    known = [s.name for s in LLM_SETTINGS]
    out: dict[str, Any] = {}
    for name, value in settings.items():
        target = ALIASES.get(name, name)
        if target not in known:
            raise TypeError(f"unknown setting '{name}'{did_you_mean(name, known + list(ALIASES))}")
        if target in out and out[target] is not None and value is not None and out[target] != value:
            raise SettingError(f"give {target} or {name}, not two different values")
        if value is not None or target not in out:
            out[target] = value
    return out
