"""The `pagedgen` command line (Typer): parse, call, render — the work lives in run_job.py.

Everything a person reads goes to stderr (Rich); files carry the results. Exit statuses of
`run` are in exit_codes.py.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

from pagedgen.jobs.config import ConfigError, load_config, parse_set_option
from pagedgen.cli.store import store_app
from pagedgen.cli.exit_codes import EXIT_CODES_HELP, EXIT_INTERNAL, EXIT_USAGE, EXIT_WRITE_FAILED
from pagedgen.cli.setting_flags import FLAG_TO_SETTING, with_setting_flags
from pagedgen.settings import SETTINGS

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batch generation on a paged KV cache.")


def _stderr() -> Console:
    # soft_wrap: paths, messages and the resume command stay on one line, ready to copy.
    return Console(stderr=True, soft_wrap=True)


def _print_version(value: bool) -> None:
    if value:
        from pagedgen import __version__

        print(f"pagedgen {__version__}")
        raise typer.Exit()


app.add_typer(store_app, name="store")


@app.callback()
def _main(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the version and exit.")) -> None:
    """Offline batch generation on a paged KV cache (PagedAttention)."""


# Flag -> config key; None means "not given", so the config file's value stands. The settings'
# flags come from the settings table (setting_flags.py); these are the sections' own.
_SAMPLING_FLAGS = {"--max-tokens": "max_tokens", "--temperature": "temperature",
                   "--top-p": "top_p", "--top-k": "top_k", "--n": "n"}
_OUTPUT_FLAGS = {"--output": "path", "--errors": "errors_path", "--report-dir": "report_dir",
                 "--ordered": "ordered"}
# Naming a Ray address or a replica count means running on Ray.
_RAY_FLAGS = {"--ray": "enabled", "--address": "address", "--replicas": "replicas"}


def _overrides(flags: dict[str, Any], settings: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(source, values) pairs: every --set in order, then the named flags (which win)."""
    overrides = [(f"--set {s}", parse_set_option(s)) for s in settings]
    for flag, value in flags.items():
        if value is None:
            continue
        value = str(value) if isinstance(value, Path) else value
        if flag in FLAG_TO_SETTING:
            overrides.append((flag, {FLAG_TO_SETTING[flag]: value}))
        elif flag in _SAMPLING_FLAGS:
            overrides.append((flag, {"sampling": {_SAMPLING_FLAGS[flag]: value}}))
        elif flag in _RAY_FLAGS:
            overrides.append((flag, {"ray": {_RAY_FLAGS[flag]: value, "enabled": value is not False}}))
        else:
            overrides.append((flag, {"output": {_OUTPUT_FLAGS[flag]: value}}))
    return overrides


def _print_outcome(console: Console, summary: Any, paths: Any, command: str) -> None:
    if summary.write_error is not None:
        _print_write_error(console, summary, paths, command)
        return
    if summary.interrupted_by:
        console.print(f"[bold yellow]Interrupted by {summary.interrupted_by}[/]: {summary.done} of "
                      f"{summary.total} requests done, all saved in {paths.output}.")
        console.print(f"Resume with: {command}", highlight=False, markup=False)
        return
    style = "red" if summary.failed else "green"
    console.print(f"[bold {style}]{summary.done} of {summary.total} requests answered[/]"
                  + (f" ({summary.already_done} from an earlier run)" if summary.already_done else "")
                  + (f", [red]{summary.failed} failed[/]" if summary.failed else ""))
    for message in summary.first_errors:  # why, at once: the errors file has every record
        console.print(f"  {message}", highlight=False, markup=False)
    if summary.failed > len(summary.first_errors):
        console.print(f"  ... {summary.failed - len(summary.first_errors)} more in the errors file")
    for label, path in _written_files(summary, paths):
        console.print(f"  {label + ':':<12} {path}")


def _print_write_error(console: Console, summary: Any, paths: Any, command: str) -> None:
    """Disk full and its kin: which file, why, what is safe, how to go on."""
    console.print(f"[bold red]error:[/] {escape(str(summary.write_error))}", highlight=False)
    console.print(f"{summary.done:,} of {summary.total:,} answers are saved in {paths.output} "
                  "(no partial record or temporary file was left). Free some space (or fix the "
                  "cause), then resume with:", highlight=False)
    console.print(command, highlight=False, markup=False)


def _written_files(summary: Any, paths: Any) -> list[tuple[str, Path]]:
    """The files to point at, checked on disk: a run whose every line failed before generation
    never creates the completions file, and naming it would send the user looking for nothing."""
    candidates = [("completions", paths.output), ("errors", paths.errors if summary.failed else None),
                  ("in order", paths.ordered), *(("report", f) for f in summary.report_files)]
    return [(label, path) for label, path in candidates if path is not None and path.exists()]


class _ArgvCommand(TyperCommand):
    """Keeps the command's own arguments as typed, for the resume hint and the run manifest
    (click keeps only the parsed values)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta["pagedgen.argv"] = list(args)
        return super().parse_args(ctx, args)


def _command_line(ctx: typer.Context) -> list[str]:
    """The argv of this `pagedgen run` as the user typed it."""
    return ["pagedgen", ctx.info_name or "run", *ctx.meta.get("pagedgen.argv", [])]


def _internal_error(console: Console, exc: BaseException, log: Path | None, debug: bool) -> None:
    """A fault of the whole run: one line on the terminal, the traceback in a log file."""
    import traceback

    text = "".join(traceback.format_exception(exc))
    saved = _save_log(text, log)
    if debug:
        console.print(text, markup=False, highlight=False)
    where = f"; the traceback is in {saved}" if saved else ""
    console.print(f"[bold red]internal error:[/] {type(exc).__name__}: {escape(_one_line(exc) + where)}",
                  highlight=False)
    raise typer.Exit(EXIT_INTERNAL)


def _save_log(text: str, log: Path | None) -> Path | None:
    """`log` (a path the run checked it may write), else a new temporary file."""
    import os
    import tempfile

    from pagedgen.jobs.output_files import OutputWriteError, write_atomically

    try:
        if log is not None:
            write_atomically(log, [text.encode("utf-8", "backslashreplace")])
            return log
    except OutputWriteError:
        pass
    try:
        handle, name = tempfile.mkstemp(prefix="pagedgen-error-", suffix=".log")
        with os.fdopen(handle, "w", encoding="utf-8", errors="backslashreplace") as file:
            file.write(text)
        return Path(name)
    except OSError:
        return None


def _one_line(exc: BaseException) -> str:
    from pagedgen.validation import shorten

    return shorten(str(exc), 300)


_IO, _SAMPLING, _RESUME, _RAY = "Input/output", "Sampling", "Resume", "Ray"


@app.command(cls=_ArgvCommand, epilog=EXIT_CODES_HELP)
@with_setting_flags("run")
def run(
    ctx: typer.Context,
    prompts: Path = typer.Argument(..., help="JSONL input: prompt / messages / prompt_token_ids "
                                             "lines or OpenAI Batch API lines."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (see configs/)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", rich_help_panel=_IO,
                                          help="Completions JSONL (default: INPUT.completions.jsonl next to the input)."),
    errors: Optional[Path] = typer.Option(None, "--errors", rich_help_panel=_IO,
                                          help="Error records (default: OUTPUT.errors.jsonl)."),
    report_dir: Optional[Path] = typer.Option(None, "--report-dir", rich_help_panel=_IO,
                                              help="Memory report folder (default: OUTPUT.report/)."),
    no_report: bool = typer.Option(False, "--no-report", help="Skip the memory report.",
                                   rich_help_panel=_IO),
    ordered: Optional[bool] = typer.Option(None, "--ordered/--no-ordered", rich_help_panel=_IO,
                                           help="Also write OUTPUT.ordered.jsonl in input order."),
    resume: bool = typer.Option(False, "--resume", rich_help_panel=_RESUME,
                                help="Skip ids already in the output; run the rest."),
    overwrite: bool = typer.Option(False, "--overwrite", rich_help_panel=_RESUME,
                                   help="Start over if the output exists."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or report summary."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Default max_tokens.",
                                             rich_help_panel=_SAMPLING),
    temperature: Optional[float] = typer.Option(None, "--temperature", rich_help_panel=_SAMPLING),
    top_p: Optional[float] = typer.Option(None, "--top-p", rich_help_panel=_SAMPLING),
    top_k: Optional[int] = typer.Option(None, "--top-k", rich_help_panel=_SAMPLING),
    n: Optional[int] = typer.Option(None, "--n", help="Default samples per request.",
                                    rich_help_panel=_SAMPLING),
    settings: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                       help="Any config key, e.g. --set sampling.min_p=0.05."),
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of an internal error."),
    use_ray: Optional[bool] = typer.Option(None, "--ray/--no-ray", rich_help_panel=_RAY,
                                           help="Generate on Ray (Ray Data; pip install "
                                                "'pagedgen\\[ray]'); see the ray: config section."),
    address: Optional[str] = typer.Option(None, "--address", rich_help_panel=_RAY,
                                          help="Ray cluster to join: auto, ray://HOST:10001 "
                                               "(default: start a local instance). Implies --ray."),
    replicas: Optional[int] = typer.Option(None, "--replicas", rich_help_panel=_RAY,
                                           help="Ray replicas, each with one model copy. Implies --ray."),
    setting_flags: Optional[dict[str, Any]] = None,
) -> None:
    """Generate completions for every request in PROMPTS (resumable; nothing finished is lost).

    A bad line or a failed request becomes one error record naming its line; the rest run."""
    from pagedgen.jobs.manifest import resume_command
    from pagedgen.jobs.run_job import Job, UsageError, resolve_paths

    console = _stderr()
    flags = {**setting_flags,
             "--max-tokens": max_tokens, "--temperature": temperature, "--top-p": top_p,
             "--top-k": top_k, "--n": n, "--output": output, "--errors": errors,
             "--report-dir": report_dir, "--ordered": ordered,
             "--ray": use_ray, "--address": address, "--replicas": replicas}
    argv, job = _command_line(ctx), None
    try:
        run_config = load_config(config, _overrides(flags, settings))
        paths = resolve_paths(prompts, run_config, write_report=not no_report)
        job_type = Job
        if run_config.ray.enabled:  # the same job, generation on Ray (cli/ray_job.py)
            from pagedgen.cli.ray_job import RayJob as job_type
        job = job_type(run_config, paths, console, resume=resume, overwrite=overwrite,
                       show_progress=not quiet, command=argv)
        summary = job.run()
    except (ConfigError, UsageError) as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    except KeyboardInterrupt:  # before the job's own handlers were installed: nothing ran
        console.print("[bold yellow]Interrupted[/] before the run started.")
        raise typer.Exit(128 + signal.SIGINT) from None
    except Exception as exc:  # noqa: BLE001 - the whole run failed: log it, exit 3
        # The log goes next to the output only once the paths were checked (it may be written).
        _internal_error(console, exc, job.paths.error_log if job and job.paths_checked else None, debug)
    _print_outcome(console, summary, paths, resume_command(argv))
    raise typer.Exit(EXIT_WRITE_FAILED if summary.write_error else summary.exit_code)


# --- memory and profiling commands ---


def _fail_usage(console: Console, exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
    raise typer.Exit(EXIT_USAGE)


@app.command()
@with_setting_flags("profile", skip=("block_size",))
def profile(
    prompts: Optional[Path] = typer.Argument(None, help="JSONL workload (default: a synthetic one)."),
    block_size: list[int] = typer.Option([], "--block-size", rich_help_panel="Engine",
                                         show_default="the config's, else "
                                                      + SETTINGS["block_size"].shown_default,
                                         help=SETTINGS["block_size"].help + " Repeat to compare, "
                                              "e.g. --block-size 16 --block-size 32."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (see configs/)."),
    num_requests: int = typer.Option(64, "--num-requests", help="Synthetic workload size."),
    prompt_len: str = typer.Option("32..256", "--prompt-len", help="Synthetic prompt lengths MIN..MAX."),
    max_tokens: str = typer.Option("32..256", "--max-tokens", help="Synthetic output lengths MIN..MAX."),
    json_path: Optional[Path] = typer.Option(None, "--json", metavar="FILE",
                                             help="Also write the results as JSON to FILE."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    setting_flags: Optional[dict[str, Any]] = None,
) -> None:
    """Time the engine per phase at one or more block sizes, same workload and KV bytes."""
    from pagedgen.cli.profile import (WorkloadSpec, check_json_target, parse_range, profile_table,
                                      run_profile)
    from pagedgen.jobs.run_job import UsageError, load_llm, make_progress

    console = _stderr()
    try:
        if json_path is not None:   # before the (long) profile, not after it
            check_json_target(json_path, [("workload", prompts), ("config", config)])
        run_config = load_config(config, _overrides(setting_flags, []))
        spec = WorkloadSpec(str(prompts) if prompts else None, num_requests,
                            parse_range(prompt_len, "--prompt-len"), parse_range(max_tokens, "--max-tokens"),
                            run_config.engine.seed)
        with make_progress(console, not quiet) as progress:
            result = run_profile(run_config, block_size or [run_config.engine.block_size], spec,
                                 load_llm, progress)
    except (ConfigError, UsageError, ValueError, OSError) as exc:
        _fail_usage(console, exc)
    Console().print(profile_table(result))
    if json_path is not None:
        _write_json(json_path, result, console, "results")


def _write_json(path: Path, data: Any, console: Console, label: str) -> None:
    """`--json FILE` of every command: written atomically (the folder made if missing); a
    failed write is exit 4 naming the file. Where the target may be is checked before the work
    (profile: check_json_target; inspect-memory: never its --report)."""
    import json

    from pagedgen.jobs.output_files import OutputWriteError, write_atomically

    try:
        write_atomically(path, [(json.dumps(data, indent=2) + "\n").encode()])
    except OutputWriteError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(EXIT_WRITE_FAILED) from None
    console.print(f"  {label}: {path}")


@app.command("inspect-memory")
@with_setting_flags("inspect-memory")
def inspect_memory(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (see configs/)."),
    seq_len: list[int] = typer.Option([], "--seq-len", help="Sequence length to fit (repeatable)."),
    report: Optional[Path] = typer.Option(None, "--report", help="A memory_report.json: map its pool."),
    step: Optional[int] = typer.Option(None, "--step", help="A recorded step (default: the peak)."),
    request: Optional[str] = typer.Option(None, "--request", help="Show this request's block table."),
    sample: int = typer.Option(0, "--sample", help="Which sample of --request (n > 1)."),
    token: Optional[int] = typer.Option(None, "--token", help="Translate this token index of --request."),
    json_path: Optional[Path] = typer.Option(None, "--json", metavar="FILE",
                                             help="Also write the figures as JSON to FILE "
                                                  "('-': print JSON instead of the tables)."),
    setting_flags: Optional[dict[str, Any]] = None,
) -> None:
    """KV sizing arithmetic for a model, or (--report) the pool map and a token's address."""
    import json

    from pagedgen.cli.inspect_memory import checked_report, sizing_for_config, sizing_renderable
    from pagedgen.memory.inspect_report import inspect_report

    console, out = _stderr(), Console()
    try:
        if json_path is not None and report is not None and json_path.resolve() == report.resolve():
            raise ValueError(f"--json {json_path} is the --report it reads; choose another file")
        if report is not None:
            data, renderable = inspect_report(checked_report(report, step, request, sample), step,
                                              request, sample, token,
                                              width=out.width)
        else:
            data = sizing_for_config(load_config(config, _overrides(setting_flags, [])), seq_len)
            renderable = sizing_renderable(data)
    except (ConfigError, ValueError, OSError) as exc:
        _fail_usage(console, exc)
    if json_path is not None and str(json_path) == "-":
        print(json.dumps(data, indent=2))
        return
    out.print(renderable)
    if json_path is not None:
        _write_json(json_path, data, console, "figures")
