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

from pagedgen.validation import int_at_least, is_int
from pagedgen.defaults import DEFAULT_KV_MEMORY
from pagedgen.cli.input_records import validate_sampling_fields

DTYPES = ("auto", "float32", "bfloat16", "float16")

# Running without --config means these values (and DEFAULT_KV_MEMORY), which
# configs/default.yaml spells out (a test keeps the two equal).
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
    device: str = "auto"             # "auto" = CUDA when available, else CPU
    block_size: int = 16
    kv_memory: int | None = DEFAULT_KV_MEMORY  # bytes for the KV pool ("2GiB" in YAML)
    num_blocks: int | None = None    # alternative to kv_memory: exact pool size
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    threads: int | None = None
    batch_invariant: bool = False    # README "Same answer whatever the batch"
    sampling: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    output: OutputConfig = field(default_factory=OutputConfig)


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
        raise ConfigError(f"{source}: '{key}' {exc}, got {value!r} ({type(value).__name__})") from None


def _apply_output(config: RunConfig, source: str, values: Any) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: 'output' must be a mapping, got {type(values).__name__}")
    for key, value in values.items():
        if key not in _OUTPUT_CHECKS:
            raise _unknown_key(source, f"output.{key}", list(_OUTPUT_CHECKS))
        setattr(config.output, key, _checked(source, f"output.{key}", _OUTPUT_CHECKS[key], value))


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
            _apply_output(config, source, value)
        elif key in _ENGINE_CHECKS:
            setattr(config, key, _checked(source, key, _ENGINE_CHECKS[key], value))
            if key in _EXCLUSIVE and value is not None:
                setattr(config, _EXCLUSIVE[key], None)
        else:
            raise _unknown_key(source, str(key), [*_ENGINE_CHECKS, "sampling", "output"])
    return config


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file (safe_load only); an empty file is an empty mapping."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
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
        raise ConfigError(f"--set {option!r}: expected KEY=VALUE, e.g. --set sampling.top_k=20")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {option!r}: value is not valid YAML: {exc}") from None
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
