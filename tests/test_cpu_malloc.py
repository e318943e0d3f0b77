"""The CPU runner's glibc malloc tuning: applied once, and switchable off."""
import platform

import pytest

from pagedgen.model.runtime import cpu_malloc
glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc")


@glibc_only
def test_applied_once_on_glibc(monkeypatch):
    monkeypatch.setattr(cpu_malloc, "_done", False)
    monkeypatch.delenv("PAGEDGEN_MALLOC_TUNING", raising=False)
    assert cpu_malloc.keep_freed_memory()
    assert cpu_malloc.keep_freed_memory()  # second call: nothing to do, still True


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(cpu_malloc, "_done", False)
    monkeypatch.setenv("PAGEDGEN_MALLOC_TUNING", "0")
    assert not cpu_malloc.keep_freed_memory()
