"""The `pagedgen run` job: config -> requests -> LLM -> files, interruptible without loss.

Order of work: check every path the run will write and the run manifest (paths.py,
manifest.py; `--resume` refuses other settings); read and validate every input line (bad lines
become error records at once); load the model only when something is left to do; tokenize and
check each request against the model; generate, streaming each finished request to disk from
`on_output`; then write the input-ordered file and the memory report. Whatever goes wrong with
one line or one request becomes that line's error record; only a fault of the whole run
escapes. SIGINT/SIGTERM stop the run between two records, never inside one.
"""

from __future__ import annotations

import json
import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pagedgen.jobs.config import RunConfig
from pagedgen.jobs.input_records import (PLAIN_TEXT_HINT, LineLimits, Request, RequestError,
                                        check_parallel, line_byte_limit, read_requests)
from pagedgen.jobs.manifest import (ManifestError, RunManifest, differences, load_manifest,
                                   resume_command, run_settings, save_manifest)
from pagedgen.jobs.output_files import (JsonlAppender, OutputFileError, OutputWriteError,
                                       RequestResult, ResumeState, SampleResult, TokenLogprob,
                                       encode_line, error_record, read_resume_state, result_record,
                                       tidy_output, write_atomically, write_ordered)
from pagedgen.jobs.output_lock import OutputLock, OutputLocked
from pagedgen.jobs.paths import (JobPaths, UsageError, check_paths, default_output_path,
                                is_stream, resolve_paths, sibling, spool_stream)
from pagedgen.jobs.prepare import Prepared, prepare
from pagedgen.jobs.stop_signals import JobInterrupted
from pagedgen.validation import shorten

if TYPE_CHECKING:
    from pagedgen.llm import LLM
    from pagedgen.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["Job", "JobPaths", "JobSummary", "UsageError", "default_output_path", "load_llm",
           "make_progress", "prepare", "resolve_paths", "sibling"]



@dataclass(slots=True)
class JobSummary:
    total: int                       # requests in the input (non-blank lines)
    already_done: int = 0            # answered by an earlier run (--resume)
    completed: int = 0               # answered by this run
    failed: int = 0                  # error records (bad lines and failed requests)
    interrupted_by: str | None = None
    write_error: OutputWriteError | None = None    # disk full or another I/O error on a file
    first_errors: list[str] = field(default_factory=list)   # "line N: why", the terminal's hint
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
    want = getattr(prepared.params, "logprobs", None) or 0
    samples = [SampleResult(o.index, o.text, list(o.token_ids), o.finish_reason, o.stop_reason,
                            _token_logprobs(o, want, tokenizer), _beam_scores(o))
               for o in output.outputs]
    return RequestResult(prepared.request, len(prepared.token_ids), samples, model_name,
                         output.usage.cached_prompt_tokens, _prompt_logprobs(output))


def _prompt_logprobs(output: RequestOutput) -> list | None:
    if output.prompt_logprobs is None:
        return None
    return [None if position is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in position.items()} for position in output.prompt_logprobs]


def _beam_scores(output: CompletionOutput) -> dict[str, float] | None:
    score = getattr(output, "score", None)   # set on the beams of a beam search request
    if score is None:
        return None
    return {"score": score, "cumulative_logprob": output.cumulative_logprob}


# --- the job ---

@dataclass(slots=True)
class OutputPlan:
    settings: dict[str, Any]     # the run's identity, for the manifest
    state: ResumeState           # what the earlier run's output holds
    pending: list[Request]       # requests still to run


class Job:
    def __init__(self, config: RunConfig, paths: JobPaths, console: Console,
                 resume: bool = False, overwrite: bool = False, show_progress: bool = True,
                 command: list[str] | None = None):
        self.config, self.paths, self.console = config, paths, console
        self.resume, self.overwrite, self.show_progress = resume, overwrite, show_progress
        self.command = command or []
        self.signals = StopSignals()
        self.entries: list[Request | RequestError] = []
        self.errors: dict[int, RequestError] = {}       # by input line
        self._errors_file: JsonlAppender | None = None
        self.summary = JobSummary(total=0)
        self.paths_checked = False      # every target may be written (check_start passed)
        self.lock = OutputLock(paths.lock, self.command)
        self.stream_input: Path | None = None   # the pipe / stdin read into paths.input

    # before anything runs: every problem here is a UsageError (exit 2)
    def check_start(self) -> RunManifest | None:
        """Paths, flags and the earlier run's manifest; returns that manifest (or None)."""
        if self.resume and self.overwrite:
            raise UsageError("--resume and --overwrite contradict each other; pass one of them")
        try:  # a default that no line could run with is the config's mistake, not each line's
            check_parallel(self.config.sampling, self.config.engine.max_num_seqs)
        except ValueError as exc:
            raise UsageError(f"sampling defaults: {exc}") from None
        check_paths(self.paths)
        try:   # before reading anything of the output: no other process may be writing it
            self.lock.acquire(f"the output {self.paths.output}")
        except OutputLocked as exc:
            raise UsageError(str(exc)) from None
        try:
            previous = load_manifest(self.paths.manifest)
        except ManifestError as exc:
            raise UsageError(str(exc)) from None
        self._check_ownership(previous)
        output = self.paths.output
        if output.exists() and output.stat().st_size > 0 and not (self.resume or self.overwrite):
            raise UsageError(f"{output} already exists: pass --resume to continue it "
                             "or --overwrite to start over")
        self.paths_checked = True
        return previous

    def _check_ownership(self, previous: RunManifest | None) -> None:
        """An existing non-empty file the run would write must be one pagedgen wrote."""
        for what, path in self.paths.targets():
            if path in (self.paths.manifest, self.paths.lock) or not path.exists() \
                    or path.stat().st_size == 0:   # (the lock file has its own mark: output_lock.py)
                continue
            if previous is None or not previous.owns(path):
                raise UsageError(
                    f"the {what} {path} already exists, and no run manifest ({self.paths.manifest}) "
                    "lists it as written by pagedgen, so this run will not append to, replace or "
                    "delete it (nor --resume from it: nothing says which model wrote it). Move it "
                    "away or choose another path")

    def _check_resumable(self, previous: RunManifest | None, settings: dict[str, Any]) -> None:
        if not self.resume or previous is None:
            return
        changed = differences(previous.settings, settings)
        if changed:
            hint = resume_command(previous.command) if previous.command else "the original command"
            raise UsageError(f"cannot resume {self.paths.output}: it was begun with other settings "
                             f"({len(changed)} differ):\n  " + "\n  ".join(changed)
                             + f"\nResume with the same settings ({hint}), "
                             "or pass --overwrite to start over")

    def open_output(self, requests: list[Request], previous: RunManifest | None) -> list[Request]:
        """Clean up what the earlier run left, write the manifest; returns requests still to run."""
        return self.commit_output(self.plan_output(requests, previous), previous)

    def plan_output(self, requests: list[Request], previous: RunManifest | None) -> OutputPlan:
        """What is left to do, found without writing anything but a cut partial last line."""
        settings = run_settings(self.config, self.paths.input)
        self._check_resumable(previous, settings)
        keys = {r.key for r in requests}
        try:
            state = read_resume_state(self.paths.output, keys) if self.resume else ResumeState(set(), [])
        except OutputFileError as exc:
            raise UsageError(str(exc)) from None
        pending = [r for r in requests if r.key not in state.done]
        self.summary.already_done = len(requests) - len(pending)
        return OutputPlan(settings, state, pending)

    def commit_output(self, plan: OutputPlan, previous: RunManifest | None) -> list[Request]:
        """The writes that open the output: tidied records, stale files gone, the manifest."""
        self._save_manifest(previous, plan.settings)
        if plan.state.needs_tidying:
            self._tidy(plan.state)
        # Stale companions of an earlier run would look current: errors are recomputed by this
        # run, and the ordered file is rewritten only when the run completes. Only files that
        # the manifest says pagedgen created are removed.
        stale = [self.paths.errors, self.paths.ordered] + ([self.paths.output] if self.overwrite else [])
        for path in stale:
            if path is not None and previous is not None and previous.owns(path):
                path.unlink(missing_ok=True)
        return plan.pending

    def _tidy(self, state: ResumeState) -> None:
        tidy_output(self.paths.output, state, self.paths.foreign)
        if state.duplicates:
            self.console.print(f"[yellow]warning:[/] {self.paths.output}: {state.duplicates} "
                               "duplicate record(s) of an id already answered dropped "
                               "(the first of each kept)", highlight=False)
        if state.foreign:
            self.console.print(f"[yellow]warning:[/] {self.paths.output}: {len(state.foreign)} "
                               f"record(s) whose id is not in the input moved to "
                               f"{self.paths.foreign}", highlight=False)

    def _save_manifest(self, previous: RunManifest | None, settings: dict[str, Any]) -> None:
        keep = self.resume and previous is not None
        files = {os.path.realpath(p) for _, p in self.paths.targets()}
        files |= set(previous.files) if previous is not None else set()
        save_manifest(self.paths.manifest, RunManifest(
            previous.settings if keep else settings, sorted(files),
            previous.command if keep and previous.command else self.command))

    def read_input(self) -> list[Request]:
        engine = self.config.engine
        limits = LineLimits(line_byte_limit(self.config.max_line_bytes, engine.max_model_len),
                            engine.max_num_seqs)
        try:
            self.entries = read_requests(self.paths.input, self.config.sampling, limits)
        except OSError as exc:
            raise UsageError(f"{self.paths.input}: cannot read the input: {exc.strerror}") from None
        self.summary.total = len(self.entries)
        return [e for e in self.entries if isinstance(e, Request)]

    def record_error(self, error: RequestError) -> None:
        with self.signals.deferred():
            if self._errors_file is None:
                self._errors_file = JsonlAppender(self.paths.errors)
            self._errors_file.write(error_record(error))
            self.errors[error.line] = error
            self.summary.failed += 1
            if len(self.summary.first_errors) < 3 or self._first_plain_text(error):
                self.summary.first_errors.append(error.message)

    def _first_plain_text(self, error: RequestError) -> bool:
        """A plain-text line is the newcomer's mistake: its fix is always shown once."""
        return PLAIN_TEXT_HINT in error.reason and \
            not any(PLAIN_TEXT_HINT in message for message in self.summary.first_errors)

    def prepare_all(self, pending: list[Request], llm: LLM) -> list[Prepared]:
        max_bytes = line_byte_limit(self.config.max_line_bytes, llm.max_model_len)
        prepared = []
        for request in pending:
            try:
                prepared.append(prepare(request, llm, max_bytes))
            except Exception as exc:  # noqa: BLE001 - one request's failure is its error record
                reason = str(exc) if isinstance(exc, ValueError) else \
                    f"cannot prepare this request: {type(exc).__name__}: {shorten(str(exc))}"
                self.record_error(RequestError.of(request, reason))
        return prepared

    def generate(self, prepared: list[Prepared], llm: LLM) -> None:
        """The facade's progress display (pagedgen/progress.py) draws the bar and final line."""
        by_key = {p.request.key: p for p in prepared}
        model_name, tokenizer = llm.loaded.name, llm.get_tokenizer()
        with JsonlAppender(self.paths.output) as out:
            def on_output(output: RequestOutput) -> None:
                with self.signals.deferred():
                    line = self._result_line(by_key[output.request_id], output, model_name, tokenizer)
                    if isinstance(line, RequestError):
                        self.record_error(line)
                    else:
                        out.write_line(line)
                        self.summary.completed += 1
            llm.generate([{"prompt_token_ids": p.token_ids} for p in prepared],
                         [p.params for p in prepared], use_tqdm=self.show_progress,
                         on_output=on_output,
                         request_ids=list(by_key))

    @staticmethod
    def _result_line(item: Prepared, output: RequestOutput, model_name: str,
                     tokenizer: Any) -> bytes | RequestError:
        """The encoded result, or the request's error (its own, or one building its record)."""
        if output.error:
            return RequestError.of(item.request, output.error)
        try:
            return encode_line(result_record(to_result(item, output, model_name, tokenizer)))
        except Exception as exc:  # noqa: BLE001 - one request's failure is its error record
            return RequestError.of(item.request, f"cannot write this result: "
                                                 f"{type(exc).__name__}: {shorten(str(exc))}")

    def finish(self, llm: LLM | None) -> None:
        """The ordered file and the memory report, after a complete run."""
        if self.paths.ordered is not None:
            entries = [self.errors.get(e.line, e) for e in self.entries]
            write_ordered(self.paths.output, self.paths.ordered, entries)
        if llm is not None and self.paths.report_dir is not None:
            self.summary.report_files = write_memory_report(llm, self.paths.report_dir, self.console,
                                                            show_summary=self.show_progress)

    def spool_input(self) -> None:
        """A pipe, stdin or '-' is read once, into a private copy the run then reads."""
        if is_stream(self.paths.input):
            self.stream_input, self.paths.input = self.paths.input, spool_stream(self.paths.input)

    def _run(self) -> None:
        self.spool_input()
        previous = self.check_start()
        plan = self.plan_output(self.read_input(), previous)
        # The model loads before anything is written: one that cannot load leaves no manifest.
        # A finished run resumed again does not even load it.
        llm = load_llm(self.config, self.show_progress) if plan.pending else None
        pending = self.commit_output(plan, previous)
        for entry in self.entries:
            if isinstance(entry, RequestError):
                self.record_error(entry)
        if pending:
            prepared = self.prepare_all(pending, llm)
            if prepared:
                self.generate(prepared, llm)
        self.finish(llm)

    def run(self) -> JobSummary:
        """Runs the job; UsageError escapes (nothing ran), an interruption is in the summary,
        any other exception is a fault of the whole run (the caller logs it: exit 3)."""
        with self.signals.installed():
            try:
                try:
                    self._run()
                finally:
                    self._close_files()
            except JobInterrupted as stop:
                self.summary.interrupted_by = stop.signal_name
            except OutputWriteError as exc:
                self.summary.write_error = exc
        return self.summary

    def _close_files(self) -> None:
        try:
            if self._errors_file is not None:
                self._errors_file.close()
        finally:
            self.lock.release()
            if self.stream_input is not None:
                self.paths.input.unlink(missing_ok=True)


def build_llm(config: RunConfig, show_progress: bool = False) -> LLM:
    from pagedgen.llm import LLM

    return LLM(**config.engine.as_dict(), show_progress=show_progress)


def load_llm(config: RunConfig, show_progress: bool = False) -> LLM:
    """The engine, or UsageError: a model that cannot load is a config problem (exit 2)."""
    import torch

    if config.engine.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"device {config.engine.device!r} was asked for, but CUDA is not available here "
                         "(use --device cpu or auto)")
    try:
        return build_llm(config, show_progress)
    except (OSError, ValueError) as exc:  # missing files, bad model folders, impossible sizes
        raise UsageError(f"cannot load the model: {shorten(str(exc), 1000)}") from None
    except Exception as exc:  # noqa: BLE001 - a corrupt file fails in many libraries' own ways
        raise UsageError(f"cannot load the model or set up the engine: {type(exc).__name__}: "
                         f"{shorten(str(exc), 1000)}") from None


def make_progress(console: Console, enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, disable=not enabled)


def write_memory_report(llm: LLM, report_dir: Path, console: Console,
                        show_summary: bool = True) -> list[Path]:
    """memory_report.json + memory_timeline.png in report_dir; the summary on the console."""
    from pagedgen.memory.render import render_report

    report = llm.memory_report()
    json_path = report_dir / "memory_report.json"
    write_atomically(json_path, [(json.dumps(report, indent=2) + "\n").encode()])
    if show_summary:
        render_report(report, console)
    files = [json_path]
    try:   # drawn in memory, written like every other file (atomically, errors named)
        files.append(_write_plot(report, report_dir / "memory_timeline.png"))
    except ValueError as exc:  # e.g. nothing ran: no timeline to draw
        console.print(f"[yellow]no timeline plot: {exc}[/]")
    return files


def _write_plot(report: dict[str, Any], path: Path) -> Path:
    import io

    from pagedgen.memory.plot import timeline_figure

    import matplotlib.pyplot as plt

    figure, buffer = timeline_figure(report), io.BytesIO()
    try:
        figure.savefig(buffer, format="png", dpi=110)
    finally:
        plt.close(figure)
    write_atomically(path, [buffer.getvalue()])
    return path
