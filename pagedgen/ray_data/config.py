"""The Ray Data stage's settings: plain data, checked before any replica starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedgen.settings import LLM_SETTINGS
from pagedgen.validation import require_int

# LLM keyword arguments a replica may be given: every LLM() setting of the table but the model,
# which is the stage's own field.
ENGINE_KWARGS = tuple(s.name for s in LLM_SETTINGS if s.name != "model")


@dataclass(slots=True)
class ProcessorConfig:
    """model: HF folder or .gguf path as every replica sees it (None: the built-in default).
    engine_kwargs: pagedgen.LLM options (ENGINE_KWARGS). concurrency: replicas (actors), each
    loading the model once. batch_size: rows per `generate` call inside a replica; bigger
    batches keep continuous batching fuller, smaller ones lose less work to a replica's death.
    sampling: default sampling fields under each row's own. num_cpus / num_gpus: resources
    per replica (num_cpus defaults to engine_kwargs["threads"] or 1). max_restarts /
    max_task_retries: Ray's actor fault tolerance (-1 = unlimited): a replica that dies is
    restarted and its unfinished batch is run again."""

    model: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 1
    batch_size: int = 64
    sampling: dict[str, Any] = field(default_factory=dict)
    num_cpus: float | None = None
    num_gpus: float = 0
    max_restarts: int = -1
    max_task_retries: int = -1
    runtime_env: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        require_int("concurrency", self.concurrency)
        require_int("batch_size", self.batch_size)
        require_int("max_restarts", self.max_restarts, minimum=-1)
        require_int("max_task_retries", self.max_task_retries, minimum=-1)
        unknown = sorted(set(self.engine_kwargs) - set(ENGINE_KWARGS))
        if unknown:
            raise ValueError(f"engine_kwargs: unknown option {unknown[0]!r} "
                             f"(known: {', '.join(ENGINE_KWARGS)})")

    @property
    def cpus_per_replica(self) -> float:
        return self.num_cpus if self.num_cpus is not None else (self.engine_kwargs.get("threads") or 1)

    def map_batches_kwargs(self) -> dict[str, Any]:
        """Resources and fault tolerance of the replicas, as Dataset.map_batches takes them."""
        kwargs: dict[str, Any] = {"num_cpus": self.cpus_per_replica}
        if self.num_gpus:
            kwargs["num_gpus"] = self.num_gpus
        if self.runtime_env:
            kwargs["runtime_env"] = self.runtime_env
        # Ray Data's own default for actor pools is -1/-1 (unlimited); only a different
        # choice is passed, through the actor options it forwards to Ray.
        if (self.max_restarts, self.max_task_retries) != (-1, -1):
            kwargs["max_restarts"] = self.max_restarts
            kwargs["max_task_retries"] = self.max_task_retries
        return kwargs
