"""The ``ray:`` section of a run config (and --ray, --address, --replicas): run the job's
generation on a Ray cluster through the Ray Data stage (pagedgen/ray_data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pagedgen.validation import int_at_least


@dataclass(slots=True)
class RayConfig:
    enabled: bool = False            # --ray; --address or --replicas also turn it on
    address: str | None = None       # None: start a local Ray instance; 'auto', 'ray://host:10001'
    replicas: int = 1                # actors, each with one LLM (the model loaded once per replica)
    batch_size: int = 32             # rows per generate() call inside a replica
    cpus_per_replica: float | None = None   # default: threads, or 1
    max_restarts: int = -1           # a dead replica is restarted (-1: no limit)
    max_task_retries: int = -1       # and its unfinished batch runs again (-1: no limit)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _address(value: Any) -> str | None:
    if value is not None and not (isinstance(value, str) and value.strip()):
        raise ValueError("must be 'auto', a 'ray://host:port' or 'host:port' address, or null")
    return value


def _cpus(value: Any) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or value <= 0):
        raise ValueError("must be a positive number or null")
    return value


RAY_CHECKS: dict[str, Callable[[Any], Any]] = {
    "enabled": _bool,
    "address": _address,
    "replicas": int_at_least(1),
    "batch_size": int_at_least(1),
    "cpus_per_replica": _cpus,
    "max_restarts": int_at_least(-1),
    "max_task_retries": int_at_least(-1),
}
