"""The repository's top-level kernels/ folder (shipped as pagedgen.kernels) must not hide an
installed package named `kernels` (Hugging Face's, which transformers imports) from code run at
the repository root, where the root is on sys.path: `python -m pytest`, `python -m pagedgen`."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ROOT / "kernels" / "__init__.py"


def _kernels_file_at_root(installed_dir: Path | None) -> Path:
    """`import kernels` with the repository root first on sys.path (and installed_dir right
    behind it, ahead of site-packages): the file the name resolved to."""
    extra = f"sys.path.insert(1, {str(installed_dir)!r}); " if installed_dir else ""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); {extra}"
            "import kernels; print(kernels.__file__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1]).resolve()


def test_an_installed_kernels_package_takes_the_name(tmp_path):
    installed = tmp_path / "kernels"
    installed.mkdir()
    (installed / "__init__.py").write_text("")
    assert _kernels_file_at_root(tmp_path) == (installed / "__init__.py").resolve()


def test_without_one_the_name_stays_ours():
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert _kernels_file_at_root(None) == OURS
    else:  # transformers >= 5.25 installs Hugging Face's
        assert _kernels_file_at_root(None) != OURS
