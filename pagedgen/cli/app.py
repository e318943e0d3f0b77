"""The `pagedgen` command line (Typer): parse, call, render — the work lives in run_job.py.

Everything a person reads goes to stderr (Rich); files carry the results.
Exit status of `run`: 0 all requests answered, 1 some failed (see the errors file),
2 usage or config error before anything ran, 128 + signal number when interrupted
(130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from pagedgen.cli.config import ConfigError, load_config, parse_set_option

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batch generation on a paged KV cache.")

EXIT_USAGE = 2


def _stderr() -> Console:
    # soft_wrap: paths, messages and the resume command stay on one line, ready to copy.
    return Console(stderr=True, soft_wrap=True)


@app.callback()
def _main() -> None:
    """Offline batch generation on a paged KV cache (PagedAttention)."""


# Flag -> config key; None means "not given", so the config file's value stands.
_ENGINE_FLAGS = {"--model": "model", "--dtype": "dtype", "--device": "device",
                 "--block-size": "block_size", "--kv-memory": "kv_memory",
                 "--num-blocks": "num_blocks", "--max-num-seqs": "max_num_seqs",
                 "--max-num-batched-tokens": "max_num_batched_tokens",
                 "--max-model-len": "max_model_len", "--prefix-caching": "enable_prefix_caching",
                 "--seed": "seed", "--threads": "threads",
                 "--batch-invariant": "batch_invariant"}
_SAMPLING_FLAGS = {"--max-tokens": "max_tokens", "--temperature": "temperature",
                   "--top-p": "top_p", "--top-k": "top_k", "--n": "n"}
_OUTPUT_FLAGS = {"--output": "path", "--errors": "errors_path", "--report-dir": "report_dir",
                 "--ordered": "ordered"}


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
        else:
            overrides.append((flag, {"output": {_OUTPUT_FLAGS[flag]: value}}))
    return overrides


def _print_outcome(console: Console, summary: Any, paths: Any, command: str) -> None:
    if summary.interrupted_by:
        console.print(f"[bold yellow]Interrupted by {summary.interrupted_by}[/]: {summary.done} of "
                      f"{summary.total} requests done, all saved in {paths.output}.\n"
                      f"Resume with: {command} --resume")
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


def _command_line(prompts: Path, config: Optional[Path], output: Optional[Path]) -> str:
    parts = ["pagedgen run", str(prompts)]
    parts += [f"--config {config}"] if config else []
    parts += [f"--output {output}"] if output else []
    return " ".join(parts)


@app.command()
def run(
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
) -> None:
    """Generate completions for every request in PROMPTS (resumable; nothing finished is lost)."""
    from pagedgen.cli.run_job import Job, UsageError, resolve_paths

    console = _stderr()
    flags = {"--model": model, "--dtype": dtype, "--device": device, "--block-size": block_size,
             "--kv-memory": kv_memory, "--num-blocks": num_blocks, "--max-num-seqs": max_num_seqs,
             "--max-num-batched-tokens": max_num_batched_tokens, "--max-model-len": max_model_len,
             "--prefix-caching": prefix_caching, "--seed": seed, "--threads": threads,
             "--batch-invariant": batch_invariant,
             "--max-tokens": max_tokens, "--temperature": temperature, "--top-p": top_p,
             "--top-k": top_k, "--n": n, "--output": output, "--errors": errors,
             "--report-dir": report_dir, "--ordered": ordered}
    try:
        run_config = load_config(config, _overrides(flags, settings))
        paths = resolve_paths(prompts, run_config, write_report=not no_report)
        job = Job(run_config, paths, console, resume=resume, overwrite=overwrite,
                  show_progress=not quiet)
        summary = job.run()
    except (ConfigError, UsageError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    _print_outcome(console, summary, paths, _command_line(prompts, config, output))
    raise typer.Exit(summary.exit_code)


# --- memory and profiling commands ---


def _fail_usage(console: Console, exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {exc}", highlight=False)
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

    from pagedgen.memory.inspect import (inspect_report, load_report, sizing_for_config,
                                         sizing_renderable)

    console, out = _stderr(), Console()
    try:
        if report is not None:
            data, renderable = inspect_report(load_report(report), step, request, sample, token,
                                              width=out.width)
        else:
            flags = {"--model": model, "--dtype": dtype, "--device": device, "--kv-memory": kv_memory,
                     "--num-blocks": num_blocks, "--block-size": block_size,
                     "--max-model-len": max_model_len}
            data = sizing_for_config(load_config(config, _overrides(flags, [])), seq_len)
            renderable = sizing_renderable(data)
    except (ConfigError, ValueError, OSError) as exc:
        _fail_usage(console, exc)
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        out.print(renderable)
