"""Fields of /proc/cpuinfo, for the choices that depend on what the CPU is."""
from __future__ import annotations

from pathlib import Path


def cpuinfo_value(key: str) -> str:
    """The value of the first /proc/cpuinfo line named `key` (vendor_id, Features, ...), ''
    where there is none or no such file (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.split(":", 1)[0].strip() == key and ":" in line), "")
