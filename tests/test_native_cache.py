"""The native kernel cache: private folder, atomic writes, digest-checked libraries.

A stand-in "compiler" (CC) builds a stub library with every expected symbol in a fraction of
a second, so the cache logic is tested without compiling the real kernels. Hostile libraries
are built with gcc here: one whose constructor writes a marker file (it must never run), one
with no symbols, and garbage bytes.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from pagedgen.kernels.cpu import native

from pagedgen.kernels.cpu import native_cache

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build test libraries")

STUB_MARK = 7   # amx_available() of the stub build: tells "our build" from anything else


def _gcc(source: str, out: Path) -> Path:
    c_file = out.with_suffix(".c")
    c_file.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(c_file)], check=True)
    return out


def _stub_source() -> str:
    body = [f"int {name}(void) {{ return {STUB_MARK}; }}" for name in native.FUNCTIONS]
    return "\n".join(body) + "\n"


def _fake_compiler(folder: Path, source: str) -> Path:
    """A CC that ignores the real sources and builds `source` at the -o path."""
    c_file = folder / f"stub-{hashlib.sha256(source.encode()).hexdigest()[:8]}.c"
    c_file.write_text(source)
    script = folder / f"cc-{c_file.stem}"
    script.write_text("#!/bin/sh\n"
                      'while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done\n'
                      f'exec gcc -shared -fPIC -o "$out" {c_file}\n')
    script.chmod(0o755)
    return script


def _marker_library(out: Path, marker: Path) -> Path:
    """Every expected symbol, plus a constructor that leaves a marker when the file is loaded."""
    return _gcc('#include <stdio.h>\n'
                '__attribute__((constructor)) static void planted(void) {\n'
                f'    FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("loaded", f); fclose(f); }}\n'
                '}\n' + _stub_source(), out)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """(cache root, compiler, library path) with native.load() uncached around the test."""
    compiler = _fake_compiler(tmp_path, _stub_source())
    root = tmp_path / "cache"
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(root))
    monkeypatch.delenv("PAGEDGEN_NATIVE_KERNELS", raising=False)
    native.load.cache_clear()
    yield root, compiler, root / "kernels" / native.library_name(str(compiler))
    native.load.cache_clear()


def _load_quietly():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library = native.load()
    return library, [str(w.message) for w in caught]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fresh_cache_is_private_atomic_and_records_the_digest(cache):
    root, _, library_path = cache
    library, messages = _load_quietly()
    assert messages == [] and library.amx_available() == STUB_MARK
    assert Path(library._name) == library_path
    for folder in (root, root / "kernels"):
        assert folder.stat().st_mode & 0o777 == 0o700
    assert native_cache.digest_path(library_path).read_text().strip() == _sha256(library_path)
    assert sorted(p.name for p in library_path.parent.iterdir()) == sorted(
        [library_path.name, library_path.name + ".sha256"])   # no temporary leftovers


@pytest.mark.parametrize("sidecar", ["none", "stale"])
def test_planted_library_is_rebuilt_and_its_constructor_never_runs(cache, tmp_path, sidecar):
    root, _, library_path = cache
    native_cache.private_folder(root)
    marker = tmp_path / "PLANTED_CODE_RAN"
    _marker_library(library_path, marker)
    if sidecar == "stale":   # a digest file that does not describe the planted bytes
        native_cache.digest_path(library_path).write_text("0" * 64 + "\n")
    library, messages = _load_quietly()
    assert not marker.exists(), "the planted library was loaded"
    assert messages == [] and library.amx_available() == STUB_MARK
    assert native_cache.is_verified(library_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_cached_library_is_rebuilt(cache, damage):
    _, _, library_path = cache
    assert native.load() is not None
    good = library_path.read_bytes()
    # A new file renamed over it: this process still maps the old one (writing in place under
    # a live mapping would crash it), as a later process would find the damaged file.
    damaged = library_path.with_name("damaged")
    damaged.write_bytes({"truncated": good[: len(good) // 2], "garbage": os.urandom(len(good)),
                         "empty": b""}[damage])
    os.replace(damaged, library_path)
    native.load.cache_clear()
    library, messages = _load_quietly()
    assert messages == [] and library.amx_available() == STUB_MARK
    assert _sha256(library_path) == native_cache.digest_path(library_path).read_text().strip()


def test_symbol_less_library_in_the_cache_is_rebuilt(cache, tmp_path):
    root, _, library_path = cache
    native_cache.private_folder(root)
    _gcc("int unrelated(void) { return 1; }\n", library_path)
    library, messages = _load_quietly()
    assert messages == [] and library.amx_available() == STUB_MARK


def test_a_build_lacking_symbols_falls_back_to_torch_with_one_warning(cache, tmp_path, monkeypatch):
    names = list(native.FUNCTIONS)
    partial = "\n".join(f"int {n}(void) {{ return 0; }}" for n in names if n != "rope_bf16") + "\n"
    monkeypatch.setenv("CC", str(_fake_compiler(tmp_path, partial)))
    library, messages = _load_quietly()
    assert library is None
    (message,) = messages
    assert "\n" not in message and "lacks the function rope_bf16" in message and "using torch" in message
    # The callers take the torch path: nothing native is attempted.
    x = torch.zeros(2, 1, 4, dtype=torch.bfloat16)
    assert native.rope(x, torch.zeros(2, 2, 2, dtype=torch.bfloat16)) is None


def _plant_with_valid_digest(root: Path, library_path: Path, marker: Path) -> None:
    """A planted library whose sidecar matches it: only the folder's privacy protects."""
    (root / "kernels").mkdir(parents=True)
    _marker_library(library_path, marker)
    native_cache.digest_path(library_path).write_text(_sha256(library_path) + "\n")


@pytest.mark.parametrize("where,mode,reason", [("root", 0o777, "writable by others"),
                                               ("root", 0o770, "writable by its group"),
                                               ("kernels", 0o757, "writable by others")])
def test_shared_writable_cache_folder_is_not_used(cache, tmp_path, where, mode, reason):
    root, _, library_path = cache
    marker = tmp_path / "PLANTED_CODE_RAN"
    _plant_with_valid_digest(root, library_path, marker)
    (root if where == "root" else root / "kernels").chmod(mode)
    library, messages = _load_quietly()
    assert not marker.exists(), "a library from a shared writable folder was loaded"
    (message,) = messages
    assert "\n" not in message and "native kernel cache not used" in message and reason in message
    assert library.amx_available() == STUB_MARK            # built privately for this process
    assert not Path(library._name).is_relative_to(root)


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown needs root")
def test_cache_folder_owned_by_another_user_is_not_used(cache, tmp_path):
    root, _, library_path = cache
    marker = tmp_path / "PLANTED_CODE_RAN"
    _plant_with_valid_digest(root, library_path, marker)
    os.chown(root / "kernels", 65534, 65534)
    library, messages = _load_quietly()
    assert not marker.exists()
    (message,) = messages
    assert "owned by another user" in message and library.amx_available() == STUB_MARK
