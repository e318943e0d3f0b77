"""A Rich progress bar for generate(): requests done of total, generated tokens/s, KV blocks.

It only draws on a terminal: when stdout is a file or a pipe (CI, the CLI streaming to disk),
the bar would be noise, so it stays silent.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class GenerationProgress:
    def __init__(self, total: int, num_blocks: int, enabled: bool = True) -> None:
        self.total = total
        self.num_blocks = num_blocks
        self.enabled = enabled and sys.stdout.isatty()
        self._progress: Progress | None = None
        self._task = None
        self._start = time.perf_counter()
        self._tokens = 0

    def __enter__(self) -> GenerationProgress:
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[speed]}"), TextColumn("{task.fields[kv]}"),
                TimeElapsedColumn(), transient=False)
            self._progress.start()
            self._task = self._progress.add_task("generate", total=self.total, speed="", kv="")
        self._start = time.perf_counter()
        return self

    def update(self, finished: int, generated_tokens: int, blocks_used: int) -> None:
        """finished: requests completed in this step; generated_tokens: the running total."""
        self._tokens = generated_tokens
        if self._progress is None:
            return
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._progress.update(
            self._task, advance=finished, speed=f"{generated_tokens / elapsed:,.1f} tok/s",
            kv=f"KV {blocks_used}/{self.num_blocks} blocks")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
