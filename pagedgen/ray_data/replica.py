"""One replica of the stage: a Ray actor that loads the model once and keeps one LLM.

Ray Data constructs the class on each actor of the pool and calls it once per batch; the
batch is one `LLM.generate` call, so continuous batching fills the engine with the whole
batch. Every row gets an answer: its result record, or an error message in the ``error``
column. A row never raises; a failure of the whole `generate` call becomes an error on each
of the batch's rows (the engine has already dropped the batch, so the replica stays usable).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pagedgen.jobs.input_records import Request, RequestError
from pagedgen.jobs.output_files import error_record, result_record
from pagedgen.jobs.run_job import Prepared, prepare, to_result
from pagedgen.ray_data.config import ProcessorConfig
from pagedgen.ray_data.rows import row_request

# Columns the stage adds (the input's own columns are carried through beside them).
OUTPUT_SCHEMA = pa.schema([
    ("generated_text", pa.string()),          # the first sample's text ("" on error)
    ("generated_tokens", pa.list_(pa.int64())),
    ("finish_reason", pa.string()),
    ("num_input_tokens", pa.int64()),
    ("num_generated_tokens", pa.int64()),     # over all samples (n > 1)
    ("num_cached_tokens", pa.int64()),        # prompt tokens served by the prefix cache
    ("record", pa.string()),                  # the `pagedgen run` output (or error) record, JSON
    ("error", pa.string()),                   # "" on success, else why the row failed
    ("replica", pa.string()),                 # host-pid of the replica that answered
    ("replica_report", pa.string()),          # on one row per batch: the replica's report, JSON
])


@dataclass(slots=True)
class RowAnswer:
    record: dict[str, Any]
    error: str = ""
    text: str = ""
    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None
    input_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0


class PagedgenReplica:
    def __init__(self, config: ProcessorConfig):
        from pagedgen.llm import LLM

        self.config = config
        kwargs = dict(config.engine_kwargs)
        # One torch thread per reserved CPU unless told: more would fight the other replicas.
        if kwargs.get("threads") is None:
            kwargs["threads"] = max(1, int(config.cpus_per_replica))
        started = time.perf_counter()
        self.llm = LLM(config.model, **kwargs)
        self.name = f"{socket.gethostname()}-{os.getpid()}"
        self.counts = {"batches": 0, "rows": 0, "failed_rows": 0, "load_seconds":
                       time.perf_counter() - started, "generate_seconds": 0.0,
                       "generate_cpu_seconds": 0.0,   # this process's CPU time inside generate()
                       "ready_at": time.time(), "last_batch_at": None}   # wall clock

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        answers = self.answer([row_request(row, self.config.sampling) for row in rows])
        self.counts["batches"] += 1
        self.counts["rows"] += len(rows)
        self.counts["failed_rows"] += sum(1 for a in answers if a.error)
        self.counts["last_batch_at"] = time.time()
        return _with_columns(batch, answers, self.name, json.dumps(self.report()))

    def answer(self, requests: list[Request | RequestError]) -> list[RowAnswer]:
        answers: list[RowAnswer | None] = [None] * len(requests)
        prepared: dict[int, Prepared] = {}
        for i, request in enumerate(requests):
            if isinstance(request, RequestError):
                answers[i] = _error_answer(request)
                continue
            try:
                prepared[i] = prepare(request, self.llm)
            except ValueError as exc:
                answers[i] = _error_answer(RequestError.of(request, str(exc)))
        for i, answer in self._generate(prepared).items():
            answers[i] = answer
        return answers

    def _generate(self, prepared: dict[int, Prepared]) -> dict[int, RowAnswer]:
        if not prepared:
            return {}
        batch_id = self.counts["batches"]
        ids = [f"{batch_id}-{i}" for i in prepared]
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            outputs = self.llm.generate([{"prompt_token_ids": p.token_ids} for p in prepared.values()],
                                        [p.params for p in prepared.values()], use_tqdm=False,
                                        request_ids=ids)
        except Exception as exc:  # noqa: BLE001 - the batch's rows fail, the dataset goes on
            reason = f"generation failed on replica {self.name}: {type(exc).__name__}: {exc}"
            return {i: _error_answer(RequestError.of(p.request, reason)) for i, p in prepared.items()}
        finally:
            self.counts["generate_seconds"] += time.perf_counter() - started
            self.counts["generate_cpu_seconds"] += time.process_time() - cpu_started
        return {i: self._answer(p, output) for (i, p), output in zip(prepared.items(), outputs)}

    def _answer(self, item: Prepared, output: Any) -> RowAnswer:
        if output.error:
            return _error_answer(RequestError.of(item.request, output.error))
        result = to_result(item, output, self.llm.loaded.name, self.llm.get_tokenizer())
        first = result.samples[0]
        return RowAnswer(result_record(result), "", first.text, tuple(first.token_ids),
                         first.finish_reason, result.prompt_tokens,
                         result.usage["completion_tokens"], result.cached_prompt_tokens)

    def report(self) -> dict[str, Any]:
        """Everything this replica did so far: counts, engine stats and its memory report."""
        return {"replica": self.name, **self.counts, "stats": self.llm.stats,
                "memory_report": self.llm.memory_report()}


def _error_answer(error: RequestError) -> RowAnswer:
    return RowAnswer(error_record(error), error.reason)


def _with_columns(batch: pa.Table, answers: list[RowAnswer], replica: str, report: str) -> pa.Table:
    columns = {
        "generated_text": [a.text for a in answers],
        "generated_tokens": [list(a.tokens) for a in answers],
        "finish_reason": [a.finish_reason for a in answers],
        "num_input_tokens": [a.input_tokens for a in answers],
        "num_generated_tokens": [a.generated_tokens for a in answers],
        "num_cached_tokens": [a.cached_tokens for a in answers],
        "record": [json.dumps(a.record, ensure_ascii=False) for a in answers],
        "error": [a.error for a in answers],
        "replica": [replica] * len(answers),
        # The report is cumulative: one copy per batch is enough to keep the latest.
        "replica_report": [report if i == 0 else "" for i in range(len(answers))],
    }
    added = pa.Table.from_pydict(columns, schema=OUTPUT_SCHEMA)
    kept = batch.drop_columns([n for n in OUTPUT_SCHEMA.names if n in batch.column_names])
    for name in added.column_names:
        kept = kept.append_column(added.schema.field(name), added.column(name))
    return kept
