"""`pagedgen store stats|clear|verify DIR`: look after a prefix store folder (docs/prefix_store.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console

from pagedgen.cli.exit_codes import EXIT_USAGE

store_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Look after a prefix store folder (KV blocks kept on disk).")

_FOLDER = typer.Argument(..., help="The prefix store folder (--prefix-store DIR).")


def _open(folder: Path):
    from pagedgen.engine.prefix_store import BlockStore

    console = Console(stderr=True, soft_wrap=True)
    if not folder.is_dir():
        console.print(f"[red]Error:[/] {folder} is not a folder")
        raise typer.Exit(EXIT_USAGE)
    try:
        return BlockStore(folder, create=False)
    except OSError as error:  # not private, or not a store
        console.print(f"[red]Error:[/] {error}")
        raise typer.Exit(EXIT_USAGE) from None


@store_app.command()
def stats(folder: Path = _FOLDER,
          as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text.")) -> None:
    """Blocks, bytes on disk, the size limit and the age of the oldest block."""
    store = _open(folder)
    result = store.stats()
    data = {"folder": str(folder), "blocks": result.files, "bytes_on_disk": result.bytes,
            "file_bytes": result.logical_bytes, "max_bytes": store.max_bytes,
            "oldest_age_s": None if result.oldest_mtime is None else time.time() - result.oldest_mtime}
    if as_json:
        print(json.dumps(data, indent=2))
        return
    age = "-" if data["oldest_age_s"] is None else f"{data['oldest_age_s'] / 3600:.1f} h"
    print(f"{folder}: {result.files} blocks, {result.bytes / 2**20:.1f} MiB on disk "
          f"(limit {store.max_bytes / 2**30:.0f} GiB), least recently used block {age} ago")


@store_app.command()
def clear(folder: Path = _FOLDER) -> None:
    """Removes every block (the folder stays)."""
    removed = _open(folder).clear()
    print(f"{folder}: removed {removed} files")


@store_app.command()
def verify(folder: Path = _FOLDER,
           keep: bool = typer.Option(False, "--keep", help="Report bad blocks without removing them.")) -> None:
    """Reads every block whole and checks it; bad ones are removed (exit status 1 if any)."""
    result = _open(folder).verify(remove_bad=not keep)
    for line in result.bad[:50]:
        print(f"bad: {line}")
    print(f"{folder}: {result.good} good blocks, {len(result.bad)} bad ({result.removed} removed), "
          f"{result.temporary_removed} stale temporary files removed")
    if result.bad:
        raise typer.Exit(1)
