"""Typed run configuration: YAML file + command-line overrides, validated with clear messages.

A config file is a flat mapping of engine settings plus two sections, ``sampling`` (default
sampling parameters, overridden per request by the input lines) and ``output`` (where files go).
Every error names the file (or flag) and the key, and suggests the closest known key for typos:

    configs/x.yaml: unknown key 'blok_size' (did you mean 'block_size'?)
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from pagedgen.validation import brief, int_at_least, is_int, shorten
from pagedgen.engine.engine_config import EngineConfig
from pagedgen.cli.input_records import validate_sampling_fields
from pagedgen.cli.ray_settings import RAY_CHECKS, RayConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")

# Running without --config means these values, which configs/default.yaml spells out (a test
# keeps the two equal). The engine's limits are EngineConfig's defaults, the ones LLM() uses.
_ENGINE = EngineConfig()
DEFAULT_SAMPLING = {"n": 1, "max_tokens": 256, "temperature": 0.7, "top_p": 0.95, "top_k": 0,
                    "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "repetition_penalty": 1.0}


class ConfigError(ValueError):
    """A config file or flag is wrong; the message names the source and the key."""


@dataclass(slots=True)
class OutputConfig:
    path: str | None = None          # default: next to the input, INPUT.completions.jsonl
    errors_path: str | None = None   # default: OUTPUT.errors.jsonl
    report_dir: str | None = None    # default: OUTPUT.report/ next to the output
    ordered: bool = True             # also write OUTPUT.ordered.jsonl (input order) at the end


@dataclass(slots=True)
class RunConfig:
    model: str | None = None         # HF folder, .gguf file, or None for the built-in default
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"     # "auto" (the model's dtype), "int8", "fp8_e4m3", "fp8_e5m2"
    device: str = "auto"             # "auto" = CUDA when available, else CPU
    block_size: int = _ENGINE.block_size
    kv_memory: int | None = None     # bytes for the KV pool ("2GiB" in YAML); both None: the
    num_blocks: int | None = None    # runner's default (model/runtime/kv_cache.py: size_kv_pool)
    max_num_seqs: int = _ENGINE.max_num_seqs
    max_num_batched_tokens: int = _ENGINE.max_num_batched_tokens
    max_model_len: int | None = None
    enable_prefix_caching: bool = _ENGINE.enable_prefix_caching
    seed: int = _ENGINE.seed
    threads: int | None = None
    max_line_bytes: int | None = None  # None: derived from max_model_len (see input_limits)
    batch_invariant: bool = False    # README "Same answer whatever the batch"
    sampling: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    output: OutputConfig = field(default_factory=OutputConfig)
    ray: RayConfig = field(default_factory=RayConfig)   # run on Ray (ray_settings.py)


# --- value checks: each returns the normalised value or raises ValueError(requirement) ---

def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _optional_str(value: Any) -> str | None:
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError("must be a non-empty string or null")
    return value


def _model(value: Any) -> str | None:
    # "default" reads better in YAML than null for the built-in model.
    return None if value == "default" else _optional_str(value)


def _dtype(value: Any) -> str:
    value = "auto" if value is None else value
    if value not in DTYPES:
        raise ValueError(f"must be one of {', '.join(DTYPES)}")
    return value


def _kv_cache_dtype(value: Any) -> str:
    from pagedgen.model.runtime.kv_cache import KV_CACHE_DTYPES

    value = "auto" if value is None else value
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"must be one of {', '.join(KV_CACHE_DTYPES)}")
    return value


def _device(value: Any) -> str:
    value = "auto" if value is None else value
    if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ValueError("must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return value


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Any) -> int:
    """Bytes from an integer or a string such as '2GiB', '512 MiB', '1.5GB'."""
    if is_int(value) and value > 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    unit = match and _SIZE_UNITS.get(match.group(2).lower())
    if not unit or float(match.group(1)) <= 0:
        raise ValueError("must be a positive size such as '2GiB', '512MiB' or a number of bytes")
    return int(float(match.group(1)) * unit)


_ENGINE_CHECKS: dict[str, Callable[[Any], Any]] = {
    "model": _model,
    "dtype": _dtype,
    "kv_cache_dtype": _kv_cache_dtype,
    "device": _device,
    "block_size": int_at_least(1),
    "kv_memory": _optional(parse_size),
    "num_blocks": _optional(int_at_least(1)),
    "max_num_seqs": int_at_least(1),
    "max_num_batched_tokens": int_at_least(1),
    "max_model_len": _optional(int_at_least(2)),
    "enable_prefix_caching": _bool,
    "seed": int_at_least(0),
    "threads": _optional(int_at_least(1)),
    "max_line_bytes": _optional(parse_size),
    "batch_invariant": _bool,
}

_OUTPUT_CHECKS: dict[str, Callable[[Any], Any]] = {
    "path": _optional_str,
    "errors_path": _optional_str,
    "report_dir": _optional_str,
    "ordered": _bool,
}

# Setting one of these clears the other, so a flag can replace the file's choice.
_EXCLUSIVE = {"kv_memory": "num_blocks", "num_blocks": "kv_memory"}


def _unknown_key(source: str, key: str, known: list[str]) -> ConfigError:
    name = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(sorted(known))})"
    return ConfigError(f"{source}: unknown key '{key}'{hint}")


def _checked(source: str, key: str, check: Callable[[Any], Any], value: Any) -> Any:
    try:
        return check(value)
    except ValueError as exc:
        raise ConfigError(f"{source}: '{key}' {exc}, got {brief(value)} ({type(value).__name__})") from None


def _apply_section(section: Any, name: str, checks: dict[str, Any], source: str, values: Any) -> None:
    """A nested mapping of the config (output:, ray:), each key checked and set on `section`."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: '{name}' must be a mapping, got {type(values).__name__}")
    for key, value in values.items():
        if key not in checks:
            raise _unknown_key(source, f"{name}.{key}", list(checks))
        setattr(section, key, _checked(source, f"{name}.{key}", checks[key], value))


def _apply_sampling(config: RunConfig, source: str, values: Any) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: 'sampling' must be a mapping, got {type(values).__name__}")
    try:
        config.sampling.update(validate_sampling_fields(values))
    except ValueError as exc:
        raise ConfigError(f"{source}: sampling: {exc}") from None


def apply_values(config: RunConfig, values: dict[str, Any], source: str) -> RunConfig:
    """Validate `values` (a parsed YAML mapping or flag overrides) and set them on `config`."""
    for key, value in values.items():
        if key == "sampling":
            _apply_sampling(config, source, value)
        elif key == "output":
            _apply_section(config.output, "output", _OUTPUT_CHECKS, source, value)
        elif key == "ray":
            _apply_section(config.ray, "ray", RAY_CHECKS, source, value)
        elif key in _ENGINE_CHECKS:
            setattr(config, key, _checked(source, key, _ENGINE_CHECKS[key], value))
            if key in _EXCLUSIVE and value is not None:
                setattr(config, _EXCLUSIVE[key], None)
        else:
            raise _unknown_key(source, str(key), [*_ENGINE_CHECKS, "sampling", "output", "ray"])
    return config


# A config is a few dozen lines; anything far larger is a mistake (or an attack).
MAX_CONFIG_BYTES = 1 << 20


class _PlainLoader(yaml.SafeLoader):
    """safe_load without anchors and aliases: `&a [*b, *b, ...]` chains expand exponentially
    (a "billion laughs" bomb), and no pagedgen setting needs them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ConfigError(f"line {event.start_mark.line + 1}: YAML anchors and aliases "
                              "(&name, *name) are not supported; write the value out")
        return super().compose_node(parent, index)


def safe_yaml(text: str, source: str) -> Any:
    """yaml.safe_load without anchors/aliases; ConfigError names `source`."""
    try:
        return yaml.load(text, Loader=_PlainLoader)  # noqa: S506 - SafeLoader subclass
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {shorten(str(exc), 300)}") from None
    except RecursionError:
        raise ConfigError(f"{source}: YAML nested too deeply") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file (safe, no aliases); an empty file is an empty mapping."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: config file is larger than {MAX_CONFIG_BYTES} bytes")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc}") from None
    data = safe_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def dotted_to_nested(key: str, value: Any) -> dict[str, Any]:
    """'sampling.top_k', 5 -> {'sampling': {'top_k': 5}} (for `--set KEY=VALUE`)."""
    head, _, rest = key.partition(".")
    return {head: dotted_to_nested(rest, value) if rest else value}


def parse_set_option(option: str) -> dict[str, Any]:
    """`--set KEY=VALUE`; VALUE is read as YAML so `--set seed=3` gives an int."""
    key, sep, raw = option.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {brief(option)}: expected KEY=VALUE, e.g. --set sampling.top_k=20")
    value = safe_yaml(raw, f"--set {brief(option)}") if raw.strip() else None
    return dotted_to_nested(key.strip(), value)


def load_config(path: str | Path | None = None,
                overrides: list[tuple[str, dict[str, Any]]] = ()) -> RunConfig:
    """Defaults, then the YAML file, then each (source, values) override in order."""
    config = RunConfig()
    if path is not None:
        apply_values(config, read_yaml(path), str(path))
    for source, values in overrides:
        apply_values(config, values, source)
    return config


def config_as_dict(config: RunConfig) -> dict[str, Any]:
    """Plain data for logging and for the memory report's header."""
    return dataclasses.asdict(config)
