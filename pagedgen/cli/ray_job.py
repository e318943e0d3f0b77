"""`pagedgen run --ray`: the same job, with generation on a Ray cluster (Ray Data).

The driver does what `Job` does for one process — read and check every line, open or
resume the output, record bad lines, write the ordered file — and hands the pending lines
to the Ray Data stage (pagedgen/ray_data) instead of a local LLM. Results stream back as
replicas finish batches and are written at once, each id once: a batch that Ray runs again
after a replica died cannot add a second copy. Ray is imported only here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.progress import Progress

from pagedgen.jobs.config import RunConfig
from pagedgen.jobs.input_records import Request, RequestError, iter_lines
from pagedgen.jobs.output_files import JsonlAppender
from pagedgen.jobs.run_job import Job, UsageError, make_progress

_READ = ["line", "record", "error", "replica_report"]   # the stage's columns the driver reads


def processor_config(config: RunConfig) -> Any:
    """The Ray Data stage's config for this run: the same engine and sampling settings."""
    from pagedgen.ray_data.config import ENGINE_KWARGS, ProcessorConfig

    engine = {name: getattr(config.engine, name) for name in ENGINE_KWARGS}
    engine["tokenizer"] = _absolute(engine["tokenizer"])
    model = _absolute(config.engine.model)
    ray = config.ray
    return ProcessorConfig(model=model, engine_kwargs=engine, concurrency=ray.replicas,
                           batch_size=ray.batch_size, sampling=dict(config.sampling),
                           num_cpus=ray.cpus_per_replica,
                           num_gpus=1 if config.engine.device.startswith("cuda") else 0,
                           max_restarts=ray.max_restarts, max_task_retries=ray.max_task_retries)


def _absolute(path: str | None) -> str | None:
    """Replicas do not share the driver's working folder: an existing path is made absolute."""
    return str(Path(path).resolve()) if path is not None and Path(path).exists() else path


def pending_rows(path: Path, pending: list[Request]) -> list[dict[str, Any]]:
    """{"line", "input_line"} of each pending request: replicas parse the line themselves,
    by the same rules, so the request they run is the one checked here."""
    wanted = {r.line for r in pending}
    return [{"line": number, "input_line": raw.decode("utf-8")}
            for number, raw in iter_lines(path) if number in wanted]


def _last_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


class RayJob(Job):
    """A Job whose generation runs in `config.ray.replicas` Ray actors."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.replica_reports: Any = None

    def _run(self) -> None:
        self.spool_input()
        previous = self.check_start()
        pending = self.open_output(self.read_input(), previous)
        for entry in self.entries:
            if isinstance(entry, RequestError):
                self.record_error(entry)
        if pending:
            self._generate_on_ray(pending)
        self.finish(None)
        self._write_reports()

    def _generate_on_ray(self, pending: list[Request]) -> None:
        from pagedgen.ray_data import build_processor
        from pagedgen.ray_data.reports import ReplicaReports
        from pagedgen.ray_data.runtime import RayUnavailable, ray_session, require_ray

        try:
            require_ray()
        except RayUnavailable as exc:
            raise UsageError(str(exc)) from None
        stage = processor_config(self.config)
        with ray_session(self.config.ray.address) as ray:
            self._check_resources(ray, stage)
            rows = pending_rows(self.paths.input, pending)
            blocks = max(1, math.ceil(len(rows) / stage.batch_size))
            dataset = ray.data.from_items(rows, override_num_blocks=blocks)
            # No select_columns: it would be a task operator of its own, waiting for CPUs the
            # replicas hold, and results would stop streaming until every batch is done.
            results = build_processor(stage)(dataset)
            self.replica_reports = ReplicaReports()
            try:
                with make_progress(self.console, self.show_progress) as progress:
                    self._stream(results, {r.line: r for r in pending}, progress)
            except ray.exceptions.RayError as exc:
                # Rows never raise, so this is the cluster's failure: most often a replica
                # that cannot start (a model path missing on a node) or Ray giving up.
                raise UsageError(f"the Ray run stopped: {_last_line(exc)}; every result written "
                                 "so far is kept: rerun with --resume") from None

    def _check_resources(self, ray: Any, stage: Any) -> None:
        """A local instance cannot grow: too few CPUs would leave replicas waiting forever."""
        if self.config.ray.address is not None:
            return  # a cluster may autoscale; Ray reports what it waits for
        need, have = stage.concurrency * stage.cpus_per_replica, ray.cluster_resources().get("CPU", 0)
        if need > have:
            raise UsageError(f"{stage.concurrency} replicas x {stage.cpus_per_replica:g} CPUs need "
                             f"{need:g} CPUs; this machine's Ray instance has {have:g}: lower "
                             "--replicas or ray.cpus_per_replica, or pass --address of a cluster")

    def _stream(self, results: Any, by_line: dict[int, Request], progress: Progress) -> None:
        task = progress.add_task("generating on Ray", total=len(by_line))
        answered: set[int] = set()
        with JsonlAppender(self.paths.output) as out:
            for batch in results.iter_batches(batch_size=None, batch_format="pyarrow"):
                for row in batch.select(_READ).to_pylist():
                    if row["replica_report"]:
                        self.replica_reports.add(row["replica_report"])
                    if row["line"] in answered:
                        continue   # a second copy of a row (a batch that ran twice)
                    answered.add(row["line"])
                    self._write_row(row, by_line[row["line"]], out)
                    progress.advance(task)

    def _write_row(self, row: dict[str, Any], request: Request, out: JsonlAppender) -> None:
        if row["error"]:
            self.record_error(RequestError.of(request, row["error"]))
            return
        with self.signals.deferred():
            out.write(json.loads(row["record"]))
            self.summary.completed += 1

    def _write_reports(self) -> None:
        from pagedgen.ray_data.reports import summary_table

        if self.replica_reports is None or not self.replica_reports.latest:
            return
        if self.paths.report_dir is not None:
            self.summary.report_files = self.replica_reports.write(self.paths.report_dir)
        if self.show_progress:
            self.console.print(summary_table(self.replica_reports.summary()))
