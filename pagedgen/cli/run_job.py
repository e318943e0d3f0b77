"""The `pagedgen run` job: config -> requests -> LLM -> files, interruptible without loss.

Order of work: read and validate every input line (bad lines become error records at once);
open the output (refuse to clobber it, or resume it); load the model only when something is
left to do; tokenize and check each request against the model; generate, streaming each
finished request to disk from `on_output`; then write the input-ordered file and the memory
report. SIGINT/SIGTERM stop the run between two records, never inside one.
"""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pagedgen.cli.config import RunConfig
from pagedgen.cli.output_files import (JsonlAppender, OutputFileError, RequestResult, SampleResult,
                                    TokenLogprob, completed_keys, error_record, result_record,
                                    write_atomically, write_ordered)
from pagedgen.prompts import encode_chat
from pagedgen.cli.input_records import Request, RequestError, read_requests

if TYPE_CHECKING:
    from pagedgen.llm import LLM
    from pagedgen.engine.outputs import CompletionOutput, RequestOutput


class UsageError(Exception):
    """Found before anything ran (bad paths, an output that would be clobbered): exit 2."""


class JobInterrupted(Exception):
    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


@dataclass(slots=True)
class JobPaths:
    input: Path
    output: Path
    errors: Path
    ordered: Path | None        # None: not wanted
    report_dir: Path | None     # None: no memory report


def sibling(path: Path, suffix: str) -> Path:
    """out.jsonl -> out{suffix} in the same folder, e.g. '.errors.jsonl', '.report'."""
    stem = path.name.removesuffix(".jsonl")
    return path.with_name(stem + suffix)


def default_output_path(input_path: Path) -> Path:
    """prompts.jsonl -> prompts.completions.jsonl, next to the input."""
    return sibling(input_path, ".completions.jsonl")


def resolve_paths(input_path: str | Path, config: RunConfig, write_report: bool = True) -> JobPaths:
    out = config.output
    output = Path(out.path) if out.path else default_output_path(Path(input_path))
    return JobPaths(
        input=Path(input_path), output=output,
        errors=Path(out.errors_path) if out.errors_path else sibling(output, ".errors.jsonl"),
        ordered=sibling(output, ".ordered.jsonl") if out.ordered else None,
        report_dir=(Path(out.report_dir) if out.report_dir else sibling(output, ".report"))
        if write_report else None)


@dataclass(slots=True)
class JobSummary:
    total: int                       # requests in the input (non-blank lines)
    already_done: int = 0            # answered by an earlier run (--resume)
    completed: int = 0               # answered by this run
    failed: int = 0                  # error records (bad lines and failed requests)
    interrupted_by: str | None = None
    report_files: list[Path] = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.already_done + self.completed

    @property
    def exit_code(self) -> int:
        if self.interrupted_by:
            return 128 + getattr(signal, self.interrupted_by, signal.SIGINT).value
        return 1 if self.failed else 0


# --- signals ---

class StopSignals:
    """Turns SIGINT/SIGTERM into JobInterrupted, deferred while a record is being written."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._depth = 0

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signal.Signals(signum).name
        if self._depth == 0:
            raise JobInterrupted(self.received)

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        try:
            previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: signals stay with whoever owns them
            previous = {}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """No interruption inside: a record is written whole or not at all."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self.received:
            raise JobInterrupted(self.received)


# --- requests -> engine inputs ---

def prompt_token_ids(request: Request, tokenizer: Any) -> list[int]:
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    if request.messages is None:
        return tokenizer.encode(request.prompt)
    return encode_chat(tokenizer, request.messages)[1]   # the same rule as LLM.chat


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt is {len(ids)} tokens; max_model_len is {max_model_len}, which "
                         f"leaves room for prompts of at most {max_model_len - 1} tokens")
    if max(ids) >= vocab_size:
        raise ValueError(f"prompt token id {max(ids)} is outside the vocabulary (size {vocab_size})")


@dataclass(slots=True)
class Prepared:
    request: Request
    token_ids: list[int]
    params: Any                      # SamplingParams


def prepare(request: Request, llm: LLM) -> Prepared:
    """Tokenize and check one request against the loaded model; ValueError says why not."""
    from pagedgen.engine.sampling_params import SamplingParams

    ids = prompt_token_ids(request, llm.get_tokenizer())
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    check_prompt(ids, llm.max_model_len, llm.loaded.config.vocab_size)
    try:
        params = SamplingParams(**request.sampling)
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None
    return Prepared(request, ids, params)


# --- engine outputs -> results ---

def _token_logprobs(output: CompletionOutput, want: int, tokenizer: Any) -> list[TokenLogprob] | None:
    if output.logprobs is None:
        return None

    def entry(token_id: int, lp: Any) -> TokenLogprob:
        text = lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])
        return TokenLogprob(token_id, text, lp.logprob)
    tokens = []
    for token_id, position in zip(output.token_ids, output.logprobs):
        ranked = sorted(position.items(), key=lambda item: item[1].rank)[:want]
        chosen = entry(token_id, position[token_id])
        chosen.top = [entry(t, lp) for t, lp in ranked]
        tokens.append(chosen)
    return tokens


def to_result(prepared: Prepared, output: RequestOutput, model_name: str, tokenizer: Any) -> RequestResult:
    want = prepared.params.logprobs or 0
    samples = [SampleResult(o.index, o.text, list(o.token_ids), o.finish_reason, o.stop_reason,
                            _token_logprobs(o, want, tokenizer)) for o in output.outputs]
    return RequestResult(prepared.request, len(prepared.token_ids), samples, model_name,
                         output.usage.cached_prompt_tokens)


# --- the job ---

class Job:
    def __init__(self, config: RunConfig, paths: JobPaths, console: Console,
                 resume: bool = False, overwrite: bool = False, show_progress: bool = True):
        self.config, self.paths, self.console = config, paths, console
        self.resume, self.overwrite, self.show_progress = resume, overwrite, show_progress
        self.signals = StopSignals()
        self.entries: list[Request | RequestError] = []
        self.errors: dict[int, RequestError] = {}       # by input line
        self._errors_file: JsonlAppender | None = None
        self.summary = JobSummary(total=0)

    # before anything runs: every problem here is a UsageError (exit 2)
    def read_input(self) -> list[Request]:
        if not self.paths.input.is_file():
            raise UsageError(f"{self.paths.input}: no such input file")
        if self.paths.output.resolve() == self.paths.input.resolve():
            raise UsageError(f"{self.paths.output}: the output would overwrite the input")
        self.entries = read_requests(self.paths.input, self.config.sampling)
        self.summary.total = len(self.entries)
        return [e for e in self.entries if isinstance(e, Request)]

    def open_output(self, requests: list[Request]) -> list[Request]:
        """Prepare the output file; returns the requests still to run."""
        output = self.paths.output
        if self.resume and self.overwrite:
            raise UsageError("--resume and --overwrite contradict each other; pass one of them")
        exists = output.exists() and output.stat().st_size > 0
        if exists and not (self.resume or self.overwrite):
            raise UsageError(f"{output} already exists: pass --resume to continue it "
                             "or --overwrite to start over")
        if self.overwrite:
            output.unlink(missing_ok=True)
        try:
            done = completed_keys(output) if self.resume else set()
        except OutputFileError as exc:
            raise UsageError(str(exc)) from None
        # Stale companions of an earlier run would look current: errors are recomputed by this
        # run, and the ordered file is rewritten only when the run completes.
        for stale in (self.paths.errors, self.paths.ordered):
            if stale is not None:
                stale.unlink(missing_ok=True)
        pending = [r for r in requests if r.key not in done]
        self.summary.already_done = len(requests) - len(pending)
        return pending

    def record_error(self, error: RequestError) -> None:
        with self.signals.deferred():
            if self._errors_file is None:
                self._errors_file = JsonlAppender(self.paths.errors)
            self._errors_file.write(error_record(error))
            self.errors[error.line] = error
            self.summary.failed += 1

    def prepare_all(self, pending: list[Request], llm: LLM) -> list[Prepared]:
        prepared = []
        for request in pending:
            try:
                prepared.append(prepare(request, llm))
            except ValueError as exc:
                self.record_error(RequestError.of(request, str(exc)))
        return prepared

    def generate(self, prepared: list[Prepared], llm: LLM, progress: Progress) -> None:
        task = progress.add_task("generating", total=len(prepared))
        by_key = {p.request.key: p for p in prepared}
        model_name, tokenizer = llm.loaded.name, llm.get_tokenizer()
        with JsonlAppender(self.paths.output) as out:
            def on_output(output: RequestOutput) -> None:
                item = by_key[output.request_id]
                if output.error:
                    self.record_error(RequestError.of(item.request, output.error))
                else:
                    with self.signals.deferred():
                        out.write(result_record(to_result(item, output, model_name, tokenizer)))
                        self.summary.completed += 1
                progress.advance(task)
            llm.generate([{"prompt_token_ids": p.token_ids} for p in prepared],
                         [p.params for p in prepared], use_tqdm=False, on_output=on_output,
                         request_ids=list(by_key))

    def finish(self, llm: LLM | None) -> None:
        """The ordered file and the memory report, after a complete run."""
        if self.paths.ordered is not None:
            entries = [self.errors.get(e.line, e) for e in self.entries]
            write_ordered(self.paths.output, self.paths.ordered, entries)
        if llm is not None and self.paths.report_dir is not None:
            self.summary.report_files = write_memory_report(llm, self.paths.report_dir, self.console,
                                                            show_summary=self.show_progress)

    def _run(self) -> None:
        pending = self.open_output(self.read_input())
        for entry in self.entries:
            if isinstance(entry, RequestError):
                self.record_error(entry)
        llm = None
        if pending:  # a finished run resumed again does not even load the model
            llm = load_llm(self.config)
            prepared = self.prepare_all(pending, llm)
            if prepared:
                with make_progress(self.console, self.show_progress) as progress:
                    self.generate(prepared, llm, progress)
        self.finish(llm)

    def run(self) -> JobSummary:
        """Runs the job; UsageError escapes (nothing ran), an interruption is in the summary."""
        with self.signals.installed():
            try:
                try:
                    self._run()
                finally:
                    if self._errors_file is not None:
                        self._errors_file.close()
            except JobInterrupted as stop:
                self.summary.interrupted_by = stop.signal_name
        return self.summary


def build_llm(config: RunConfig) -> LLM:
    from pagedgen.llm import LLM

    return LLM(config.model, dtype=config.dtype, device=config.device,
               block_size=config.block_size, num_blocks=config.num_blocks,
               kv_memory=config.kv_memory, max_num_seqs=config.max_num_seqs,
               max_num_batched_tokens=config.max_num_batched_tokens,
               max_model_len=config.max_model_len,
               enable_prefix_caching=config.enable_prefix_caching, seed=config.seed,
               threads=config.threads, batch_invariant=config.batch_invariant)


def load_llm(config: RunConfig) -> LLM:
    """The engine, or UsageError: a model that cannot load is a config problem (exit 2)."""
    import torch

    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"device {config.device!r} was asked for, but CUDA is not available here "
                         "(use --device cpu or auto)")
    try:
        return build_llm(config)
    except (OSError, ValueError) as exc:  # missing files, bad model folders, impossible sizes
        raise UsageError(f"cannot load the model: {exc}") from None


def make_progress(console: Console, enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, disable=not enabled)


def write_memory_report(llm: LLM, report_dir: Path, console: Console,
                        show_summary: bool = True) -> list[Path]:
    """memory_report.json + memory_timeline.png in report_dir; the summary on the console."""
    from pagedgen.memory.plot import plot_timeline
    from pagedgen.memory.render import render_report

    report = llm.memory_report()
    json_path = report_dir / "memory_report.json"
    write_atomically(json_path, [(json.dumps(report, indent=2) + "\n").encode()])
    if show_summary:
        render_report(report, console)
    files = [json_path]
    try:
        files.append(plot_timeline(report, report_dir / "memory_timeline.png"))
    except ValueError as exc:  # e.g. nothing ran: no timeline to draw
        console.print(f"[yellow]no timeline plot: {exc}[/]")
    return files
