"""Which CPU ran the benchmark, and which of the instruction sets pagedgen dispatches on it has."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

# /proc/cpuinfo flag -> the name the report prints, in the order the kernels prefer them.
FEATURES = {"amx_tile": "AMX", "avx512_bf16": "AVX-512 BF16", "avx512f": "AVX-512",
            "avx2": "AVX2"}


@dataclass(slots=True, frozen=True)
class CpuInfo:
    model: str
    features: dict[str, bool]   # FEATURES' names -> present

    def summary(self) -> str:
        flags = ", ".join(f"{name} {'yes' if have else 'no'}" for name, have in self.features.items())
        return f"CPU {self.model}; {flags}"


def cpu_info(cpuinfo: str | None = None) -> CpuInfo:
    """From /proc/cpuinfo (Linux); elsewhere the model only, every feature unknown (no)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    model = _field(cpuinfo, "model name") or platform.processor() or platform.machine()
    flags = set(_field(cpuinfo, "flags").split())
    return CpuInfo(model, {name: flag in flags for flag, name in FEATURES.items()})


def _field(cpuinfo: str, key: str) -> str:
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return ""
