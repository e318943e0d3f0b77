"""The wheel ships the C kernels: every kernels/cpu/*.c and *.h is in it, and the native library
builds (or, with the same sources, is found in the kernel cache) and loads from an installed
copy, not from this checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted(p.name for p in (ROOT / "kernels" / "cpu").rglob("*") if p.suffix in (".c", ".h"))


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, timeout=300,
                   capture_output=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the package's files, so the build leaves nothing in the checkout."""
    folder = tmp_path_factory.mktemp("wheel")
    source = folder / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("pagedgen", "kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    _pip("wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(folder / "dist"))
    [built] = (folder / "dist").glob("pagedgen-*.whl")
    return built


def test_every_c_source_and_header_ships_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("pagedgen/kernels/cpu/")
                     and n.endswith((".c", ".h")))
    assert KERNEL_FILES and shipped == KERNEL_FILES


def test_the_native_library_loads_from_the_installed_package(wheel, tmp_path):
    from pagedgen.kernels.cpu import native

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here: the native kernels fall back to torch")
    target = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(target), str(wheel))
    # -S: no site processing, so this checkout's editable install cannot shadow the copy;
    # torch and the other dependencies come from the environment's site-packages.
    site_packages = sysconfig.get_paths()["purelib"]
    probe = ("import pagedgen.kernels.cpu.native as n, shutil\n"
             "compiler = shutil.which('cc') or shutil.which('gcc')\n"
             "print(n.__file__); print(n.library_name(compiler)); print(n.load() is not None)")
    result = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, timeout=600,
                            capture_output=True, text=True,
                            env={"PYTHONPATH": f"{target}:{site_packages}", "PATH": "/usr/bin:/bin",
                                 "HOME": str(Path.home())})
    assert result.returncode == 0, result.stderr
    where, library, loaded = result.stdout.split()
    assert Path(where).is_relative_to(target)
    # The installed sources and headers hash to this checkout's library: all of them shipped.
    assert library == native.library_name(compiler)
    assert loaded == "True"
