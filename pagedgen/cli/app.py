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

from pagedgen.cli.config import ConfigError, load_config, parse_set_option
from pagedgen.cli.exit_codes import EXIT_CODES_HELP, EXIT_INTERNAL, EXIT_USAGE

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batch generation on a paged KV cache.")


def _stderr() -> Console:
    # soft_wrap: paths, messages and the resume command stay on one line, ready to copy.
    return Console(stderr=True, soft_wrap=True)


@app.callback()
def _main() -> None:
    """Offline batch generation on a paged KV cache (PagedAttention)."""


# Flag -> config key; None means "not given", so the config file's value stands.
_ENGINE_FLAGS = {"--model": "model", "--dtype": "dtype", "--kv-cache-dtype": "kv_cache_dtype",
                 "--device": "device",
                 "--block-size": "block_size", "--kv-memory": "kv_memory",
                 "--num-blocks": "num_blocks", "--max-num-seqs": "max_num_seqs",
                 "--max-num-batched-tokens": "max_num_batched_tokens",
                 "--max-model-len": "max_model_len", "--prefix-caching": "enable_prefix_caching",
                 "--seed": "seed", "--threads": "threads", "--max-line-bytes": "max_line_bytes",
                 "--batch-invariant": "batch_invariant"}
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
        if flag in _ENGINE_FLAGS:
            overrides.append((flag, {_ENGINE_FLAGS[flag]: value}))
        elif flag in _SAMPLING_FLAGS:
            overrides.append((flag, {"sampling": {_SAMPLING_FLAGS[flag]: value}}))
        elif flag in _RAY_FLAGS:
            overrides.append((flag, {"ray": {_RAY_FLAGS[flag]: value, "enabled": value is not False}}))
        else:
            overrides.append((flag, {"output": {_OUTPUT_FLAGS[flag]: value}}))
    return overrides


def _print_outcome(console: Console, summary: Any, paths: Any, command: str) -> None:
    if summary.interrupted_by:
        console.print(f"[bold yellow]Interrupted by {summary.interrupted_by}[/]: {summary.done} of "
                      f"{summary.total} requests done, all saved in {paths.output}.")
        console.print(f"Resume with: {command}", highlight=False, markup=False)
        return
    style = "red" if summary.failed else "green"
    console.print(f"[bold {style}]{summary.done} of {summary.total} requests answered[/]"
                  + (f" ({summary.already_done} from an earlier run)" if summary.already_done else "")
                  + (f", [red]{summary.failed} failed[/]" if summary.failed else ""))
    for label, path in _written_files(summary, paths):
        console.print(f"  {label + ':':<12} {path}")


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

    try:
        if log is not None:
            log.write_text(text, encoding="utf-8", errors="backslashreplace")
            return log
    except OSError:
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


@app.command(cls=_ArgvCommand, epilog=EXIT_CODES_HELP)
def run(
    ctx: typer.Context,
    prompts: Path = typer.Argument(..., help="JSONL input: prompt / messages / prompt_token_ids "
                                             "lines or OpenAI Batch API lines."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (see configs/)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="Completions JSONL (default: INPUT.completions.jsonl next to the input)."),
    errors: Optional[Path] = typer.Option(None, "--errors", help="Error records (default: OUTPUT.errors.jsonl)."),
    report_dir: Optional[Path] = typer.Option(None, "--report-dir",
                                              help="Memory report folder (default: OUTPUT.report/)."),
    no_report: bool = typer.Option(False, "--no-report", help="Skip the memory report."),
    ordered: Optional[bool] = typer.Option(None, "--ordered/--no-ordered",
                                           help="Also write OUTPUT.ordered.jsonl in input order."),
    resume: bool = typer.Option(False, "--resume", help="Skip ids already in the output; run the rest."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start over if the output exists."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or report summary."),
    model: Optional[str] = typer.Option(None, "--model", help="HF folder, .gguf file, or 'default'."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto, float32, bfloat16, float16."),
    kv_cache_dtype: Optional[str] = typer.Option(None, "--kv-cache-dtype",
                                                 help="auto, int8, fp8_e4m3, fp8_e5m2 (8-bit KV pool)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu, cuda, cuda:N."),
    block_size: Optional[int] = typer.Option(None, "--block-size"),
    kv_memory: Optional[str] = typer.Option(None, "--kv-memory", help="KV pool size, e.g. 2GiB."),
    num_blocks: Optional[int] = typer.Option(None, "--num-blocks"),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs"),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    prefix_caching: Optional[bool] = typer.Option(None, "--prefix-caching/--no-prefix-caching"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    batch_invariant: Optional[bool] = typer.Option(
        None, "--batch-invariant/--no-batch-invariant",
        help="Same output bits for a request whatever shares its batches (slower)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Default max_tokens."),
    temperature: Optional[float] = typer.Option(None, "--temperature"),
    top_p: Optional[float] = typer.Option(None, "--top-p"),
    top_k: Optional[int] = typer.Option(None, "--top-k"),
    n: Optional[int] = typer.Option(None, "--n", help="Default samples per request."),
    settings: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                       help="Any config key, e.g. --set sampling.min_p=0.05."),
    max_line_bytes: Optional[str] = typer.Option(
        None, "--max-line-bytes", help="Longest input line read, e.g. 4MiB (default: 32 bytes "
                                       "per token of max_model_len, at least 64KiB)."),
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of an internal error."),
    use_ray: Optional[bool] = typer.Option(None, "--ray/--no-ray", help="Generate on Ray (Ray Data; "
                                           "pip install 'pagedgen\\[ray]'); see the ray: config section."),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster to join: auto, "
                                          "ray://HOST:10001 [default: start a local instance]. Implies --ray."),
    replicas: Optional[int] = typer.Option(None, "--replicas", help="Ray replicas, each with one "
                                           "model copy. Implies --ray."),
) -> None:
    """Generate completions for every request in PROMPTS (resumable; nothing finished is lost).

    A bad line or a failed request becomes one error record naming its line; the rest run."""
    from pagedgen.cli.manifest import resume_command
    from pagedgen.cli.run_job import Job, UsageError, resolve_paths

    console = _stderr()
    flags = {"--model": model, "--dtype": dtype, "--device": device, "--block-size": block_size,
             "--kv-memory": kv_memory, "--num-blocks": num_blocks, "--max-num-seqs": max_num_seqs,
             "--max-num-batched-tokens": max_num_batched_tokens, "--max-model-len": max_model_len,
             "--prefix-caching": prefix_caching, "--seed": seed, "--threads": threads,
             "--batch-invariant": batch_invariant,
             "--max-tokens": max_tokens, "--temperature": temperature, "--top-p": top_p,
             "--top-k": top_k, "--n": n, "--output": output, "--errors": errors,
             "--report-dir": report_dir, "--ordered": ordered, "--max-line-bytes": max_line_bytes,
             "--ray": use_ray, "--address": address, "--replicas": replicas}
    argv, job = _command_line(ctx), None
    flags["--kv-cache-dtype"] = kv_cache_dtype
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
    raise typer.Exit(summary.exit_code)


# --- memory and profiling commands ---


def _fail_usage(console: Console, exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
    raise typer.Exit(EXIT_USAGE)


@app.command()
def profile(
    prompts: Optional[Path] = typer.Argument(None, help="JSONL workload [default: a synthetic one]."),
    block_size: list[int] = typer.Option([], "--block-size", help="Repeat to compare, e.g. "
                                         "--block-size 16 --block-size 32 [default: config's]."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (see configs/)."),
    num_requests: int = typer.Option(64, "--num-requests", help="Synthetic workload size."),
    prompt_len: str = typer.Option("32..256", "--prompt-len", help="Synthetic prompt lengths MIN..MAX."),
    max_tokens: str = typer.Option("32..256", "--max-tokens", help="Synthetic output lengths MIN..MAX."),
    seed: int = typer.Option(0, "--seed", help="Workload and engine seed."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the results here."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    model: Optional[str] = typer.Option(None, "--model", help="HF folder, .gguf file, or 'default'."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto, float32, bfloat16, float16."),
    kv_cache_dtype: Optional[str] = typer.Option(None, "--kv-cache-dtype",
                                                 help="auto, int8, fp8_e4m3, fp8_e5m2 (8-bit KV pool)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu, cuda, cuda:N."),
    kv_memory: Optional[str] = typer.Option(None, "--kv-memory", help="KV pool size, e.g. 2GiB."),
    num_blocks: Optional[int] = typer.Option(None, "--num-blocks", help="Pool size at the first block size."),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs"),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    batch_invariant: Optional[bool] = typer.Option(
        None, "--batch-invariant/--no-batch-invariant",
        help="Same output bits for a request whatever shares its batches (slower)."),
) -> None:
    """Time the engine per phase at one or more block sizes, same workload and KV bytes."""
    import json

    from pagedgen.cli.profile import WorkloadSpec, parse_range, profile_table, run_profile
    from pagedgen.cli.run_job import UsageError, load_llm, make_progress

    console = _stderr()
    flags = {"--model": model, "--dtype": dtype, "--device": device, "--kv-memory": kv_memory,
             "--num-blocks": num_blocks, "--max-num-seqs": max_num_seqs,
             "--max-num-batched-tokens": max_num_batched_tokens, "--max-model-len": max_model_len,
             "--seed": seed, "--threads": threads, "--batch-invariant": batch_invariant}
    flags["--kv-cache-dtype"] = kv_cache_dtype
    try:
        run_config = load_config(config, _overrides(flags, []))
        spec = WorkloadSpec(str(prompts) if prompts else None, num_requests,
                            parse_range(prompt_len, "--prompt-len"), parse_range(max_tokens, "--max-tokens"), seed)
        with make_progress(console, not quiet) as progress:
            result = run_profile(run_config, block_size or [run_config.block_size], spec,
                                 load_llm, progress)
    except (ConfigError, UsageError, ValueError, OSError) as exc:
        _fail_usage(console, exc)
    Console().print(profile_table(result))
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"  results: {json_path}")


@app.command("inspect-memory")
def inspect_memory(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (see configs/)."),
    model: Optional[str] = typer.Option(None, "--model", help="HF folder, .gguf file, or 'default'."),
    kv_memory: Optional[str] = typer.Option(None, "--kv-memory", help="KV budget, e.g. 4GiB."),
    num_blocks: Optional[int] = typer.Option(None, "--num-blocks"),
    block_size: Optional[int] = typer.Option(None, "--block-size"),
    seq_len: list[int] = typer.Option([], "--seq-len", help="Sequence length to fit (repeatable)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto, float32, bfloat16, float16."),
    kv_cache_dtype: Optional[str] = typer.Option(None, "--kv-cache-dtype",
                                                 help="auto, int8, fp8_e4m3, fp8_e5m2 (8-bit KV pool)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu, cuda, cuda:N."),
    report: Optional[Path] = typer.Option(None, "--report", help="A memory_report.json: map its pool."),
    step: Optional[int] = typer.Option(None, "--step", help="A recorded step [default: the peak]."),
    request: Optional[str] = typer.Option(None, "--request", help="Show this request's block table."),
    sample: int = typer.Option(0, "--sample", help="Which sample of --request (n > 1)."),
    token: Optional[int] = typer.Option(None, "--token", help="Translate this token index of --request."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (for machines) instead of tables."),
) -> None:
    """KV sizing arithmetic for a model, or (--report) the pool map and a token's address."""
    import json

    from pagedgen.cli.inspect_memory import sizing_for_config, sizing_renderable
    from pagedgen.memory.inspect_report import inspect_report, load_report

    console, out = _stderr(), Console()
    try:
        if report is not None:
            data, renderable = inspect_report(load_report(report), step, request, sample, token,
                                              width=out.width)
        else:
            flags = {"--model": model, "--dtype": dtype, "--device": device, "--kv-memory": kv_memory,
                     "--num-blocks": num_blocks, "--block-size": block_size,
                     "--max-model-len": max_model_len}
            flags["--kv-cache-dtype"] = kv_cache_dtype
            data = sizing_for_config(load_config(config, _overrides(flags, [])), seq_len)
            renderable = sizing_renderable(data)
    except (ConfigError, ValueError, OSError) as exc:
        _fail_usage(console, exc)
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        out.print(renderable)
