"""Typed run configuration: YAML file + command-line overrides, validated with clear messages.

A config file is a flat mapping of the settings table's keys (pagedgen/settings/table.py, each
checked by its entry) plus three sections, ``sampling`` (default sampling parameters, overridden
per request by the input lines), ``output`` (where files go) and ``ray``.
Every error names the file (or flag) and the key, and suggests the closest known key for typos:

    configs/x.yaml: unknown key 'blok_size' (did you mean 'block_size'?)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from pagedgen.jobs.input_records import validate_sampling_fields
from pagedgen.jobs.ray_settings import RAY_CHECKS, RayConfig
from pagedgen.settings import SETTINGS, EngineConfig, SettingError, default, did_you_mean
from pagedgen.settings.kinds import size as parse_size  # noqa: F401 - the YAML size syntax
from pagedgen.validation import brief, shorten

# Running without --config means these sampling values, which configs/default.yaml spells out
# (a test keeps the two equal, and the file's settings equal to the settings table).
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
    """A run: the LLM() settings (one EngineConfig, pagedgen/settings), the job's own settings
    of the table (max_line_bytes), and the sampling, output and ray sections."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_line_bytes: int | None = default("max_line_bytes")  # None: derived from max_model_len
    sampling: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    output: OutputConfig = field(default_factory=OutputConfig)
    ray: RayConfig = field(default_factory=RayConfig)   # run on Ray (ray_settings.py)


# --- value checks of the sections: each returns the normalised value or raises ValueError ---

def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _optional_str(value: Any) -> str | None:
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError("must be a non-empty string or null")
    return value


_OUTPUT_CHECKS: dict[str, Callable[[Any], Any]] = {
    "path": _optional_str,
    "errors_path": _optional_str,
    "report_dir": _optional_str,
    "ordered": _bool,
}

def _unknown_key(source: str, key: str, known: list[str]) -> ConfigError:
    return ConfigError(f"{source}: unknown key '{key}'{did_you_mean(key.rsplit('.', 1)[-1], known)}")


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
        elif key in SETTINGS:
            _apply_setting(config, source, key, value)
        else:
            raise _unknown_key(source, str(key), [*SETTINGS, "sampling", "output", "ray"])
    return config


def _apply_setting(config: RunConfig, source: str, key: str, value: Any) -> None:
    """A key of the settings table, checked by its entry; the rules between settings are
    checked once every source is applied (load_config)."""
    setting = SETTINGS[key]
    holder = config.engine if setting.llm else config
    setattr(holder, key, _checked(source, key, setting.check, value))
    if setting.excludes and value is not None:  # a flag replaces the file's choice
        setattr(holder, setting.excludes, None)


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

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A key given twice is refused: YAML's last-wins would drop the first silently."""
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"line {line}: key {key!r} is given twice (first on line "
                                  f"{seen[key]}); keep one")
            if isinstance(key, (str, int, float, bool)):
                seen[key] = line
        return super().construct_mapping(node, deep)


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
    try:
        config.engine.validate()
    except SettingError as exc:
        sources = [str(path)] if path is not None else []
        raise ConfigError(f"{' + '.join(sources + [s for s, _ in overrides]) or 'defaults'}: {exc}") from None
    return config


def config_as_dict(config: RunConfig) -> dict[str, Any]:
    """Plain data for logging and for the memory report's header."""
    return dataclasses.asdict(config)
