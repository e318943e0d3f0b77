"""build_processor: a Dataset -> Dataset map, as `ray.data.llm.build_processor` shapes it.

    processor = build_processor(config, preprocess=..., postprocess=...)
    out = processor(ds)          # lazy, like any Dataset transformation

preprocess / postprocess are row functions run with `Dataset.map` (their own tasks); the
generation runs in `config.concurrency` replicas (an actor pool, `map_batches` with a class),
each fed `config.batch_size` rows per call. The output keeps the input's columns and adds
replica.OUTPUT_SCHEMA: completions, usage, the record, and an ``error`` column that is "" for
rows that succeeded. Replicas that die are restarted by Ray (max_restarts) and their batches
run again (max_task_retries); rows are never lost or doubled by the stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pagedgen.ray_data.config import ProcessorConfig
from pagedgen.ray_data.runtime import require_ray

RowFunction = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(slots=True)
class Processor:
    config: ProcessorConfig
    preprocess: RowFunction | None = None
    postprocess: RowFunction | None = None
    preprocess_map_kwargs: dict[str, Any] = field(default_factory=dict)
    postprocess_map_kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, dataset: Any) -> Any:
        from ray.data import ActorPoolStrategy

        from pagedgen.ray_data.replica import PagedgenReplica

        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess, **self.preprocess_map_kwargs)
        dataset = dataset.map_batches(
            PagedgenReplica, fn_constructor_args=(self.config,), batch_size=self.config.batch_size,
            batch_format="pyarrow", compute=ActorPoolStrategy(size=self.config.concurrency),
            **self.config.map_batches_kwargs())
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess, **self.postprocess_map_kwargs)
        return dataset


def build_processor(config: ProcessorConfig, preprocess: RowFunction | None = None,
                    postprocess: RowFunction | None = None,
                    preprocess_map_kwargs: dict[str, Any] | None = None,
                    postprocess_map_kwargs: dict[str, Any] | None = None) -> Processor:
    """A Processor for `config`; fails at once (RayUnavailable) when Ray Data is missing."""
    require_ray()
    return Processor(config, preprocess, postprocess, dict(preprocess_map_kwargs or {}),
                     dict(postprocess_map_kwargs or {}))
