"""The run manifest, OUT.manifest.json next to the completions file.

It records two things:
- the settings that decide what an answer is: every entry of the settings table marked
  changes_outputs (model, tokenizer, dtype, device, weights, block size, KV cache dtype,
  max_model_len, base seed, batch invariance: pagedgen/settings/table.py), the model's files
  (a digest of their sizes, first and last bytes: config, tokenizer, weight headers), the
  sampling defaults, the input's digest and the pagedgen version. `--resume` compares them with the current run's and refuses a mismatch, naming every
  field that differs, so one output file never mixes two models or two sets of defaults;
- the files the run creates: the only files a later run of the same output may replace or
  delete. A file pagedgen did not create is never truncated or removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedgen.jobs.config import RunConfig
from pagedgen.jobs.output_files import write_atomically
from pagedgen.settings import SETTINGS, outputs_identity
from pagedgen.validation import brief

MANIFEST_KIND = "pagedgen run manifest"
MANIFEST_MAX_BYTES = 1 << 20
# Bytes hashed at each end of a model file: all of a config or tokenizer file, and the header
# (tensor names, shapes, offsets) plus the first and last weights of a safetensors/GGUF file.
_EDGE_BYTES = 1 << 16
_MAX_MODEL_FILES = 256


class ManifestError(Exception):
    """A manifest that cannot be used (not ours, or another run's): exit 2."""


@dataclass(slots=True)
class RunManifest:
    settings: dict[str, Any]
    files: list[str] = field(default_factory=list)       # real paths of the files the run created
    command: list[str] = field(default_factory=list)     # argv of the run that began the file
    kind: str = MANIFEST_KIND

    def owns(self, path: Path) -> bool:
        return os.path.realpath(path) in self.files


def resume_command(argv: list[str]) -> str:
    """The shell line that resumes the run begun by `argv` (its flags kept, quoted as needed)."""
    kept = [a for a in argv if a not in ("--overwrite", "--resume")]
    return shlex.join([*kept, "--resume"])


def load_manifest(path: Path) -> RunManifest | None:
    """The manifest at `path`, None if there is none, ManifestError if the file is not one."""
    if not path.exists():
        return None
    not_ours = ManifestError(f"{path} exists but is not a pagedgen run manifest; pagedgen will "
                             "not overwrite it. Move it away or choose another --output")
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(MANIFEST_MAX_BYTES))
        if data.get("kind") != MANIFEST_KIND:
            raise not_ours
        return RunManifest(dict(data["settings"]), [str(f) for f in data["files"]],
                           [str(a) for a in data.get("command", [])])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise not_ours from None


def save_manifest(path: Path, manifest: RunManifest) -> None:
    write_atomically(path, [(json.dumps(asdict(manifest), indent=2) + "\n").encode()])


# --- what decides the answers ---

def run_settings(config: RunConfig, input_path: Path) -> dict[str, Any]:
    """Every setting of the table that changes what a run returns (its changes_outputs), the
    model's file digest, the sampling defaults, the input's digest and the version."""
    from pagedgen import __version__

    identity = {name: _identity_value(config, name) for name in outputs_identity()}
    model = config.engine.model
    return _plain({
        **identity,
        "model_files": model_digest(None if model is None else Path(model)),
        "sampling": dict(sorted(config.sampling.items())),
        "input_sha256": file_sha256(input_path),
        "pagedgen_version": __version__,
    })


def _identity_value(config: RunConfig, name: str) -> Any:
    """A setting as the manifest records it: paths by their real path (a copy elsewhere, or a
    relative path from another folder, is the same model)."""
    holder = config.engine if SETTINGS[name].llm else config
    value = getattr(holder, name)
    if name == "model" and value is None:
        return "default"
    return os.path.realpath(value) if SETTINGS[name].kind == "path" and value is not None else value


def _plain(value: Any) -> Any:
    """As it will read back from JSON (tuples become lists), so comparisons are fair."""
    return json.loads(json.dumps(value))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def model_digest(model: Path | None) -> str | None:
    """A digest of the model's files (names, sizes, first and last 64 KiB): a different model,
    a re-download of another revision or a fine-tune of the same base all change it; copying
    the same files elsewhere does not. None for the built-in default or a name that is no path."""
    if model is None or not model.exists():
        return None
    files = [model] if model.is_file() else sorted(
        p for p in model.iterdir() if p.is_file() and not p.name.startswith("."))[:_MAX_MODEL_FILES]
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(_EDGE_BYTES))
            if size > _EDGE_BYTES:
                handle.seek(max(size - _EDGE_BYTES, _EDGE_BYTES))
                digest.update(handle.read(_EDGE_BYTES))
    return digest.hexdigest()


def differences(before: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """'field: before -> now' for every field that differs (nested dicts by dotted name)."""
    found = []
    for key in sorted(set(before) | set(now), key=str):
        old, new = before.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            found += differences(old, new, f"{prefix}{key}.")
        elif old != new:
            found.append(f"{prefix}{key}: {_shown(key, old)} -> {_shown(key, new)}")
    return found


def _shown(key: str, value: Any) -> str:
    if isinstance(value, str) and (key.endswith("sha256") or key == "model_files"):
        return value[:12]
    return brief(value)
