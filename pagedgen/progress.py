"""The one progress display of the API and `pagedgen run`: a load line, a bar, a final line.

    loading SmolLM2-135M-Instruct.Q4_1.gguf (98.2 MB, GGUF) on cpu ... loaded in 2.1 s
    generating ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━  48/96 req  310 gen tok/s  1.2k prompt tok/s  KV 3.1%  ETA 0:12
    96 requests in 24.3 s: 312 generated tok/s, 1,205 prompt tok/s; KV peak 41 of 2,912 blocks (1.4%)

On a terminal the bar redraws in place (Rich); elsewhere (a CI log, a pipe) it prints a plain
line every few seconds instead, as Rich and tqdm do; `enabled=False` (-q) prints nothing.

The ETA is counted in tokens, not requests: a job whose requests all end together sits at
0/N for most of its time, so a count says nothing. Remaining time = a * steps left +
b * generated tokens left + c * prompt tokens left, where (a, b, c) are fitted on the steps
seen so far (a step's cost grows with its tokens but has a fixed part), and the tokens and steps
left come from how long sequences have run before they stopped (a product-limit estimate over
finished and still-running sequences: EOS-stopped lengths are events, running ones censored;
past the longest length seen, the recent stopping rate goes on).
Until the first sequence stops, every sequence is assumed to run to its max_tokens, so the
first ETAs are an upper bound. `estimate_eta` is a pure function of plain data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

PLAIN_EVERY_S = 5.0        # a plain line at most this often when not on a terminal
ETA_EVERY_S = 0.25         # the estimate is recomputed at most this often
COST_WINDOW = 256          # steps the cost model is fitted on (the recent ones)
RIDGE = 1e-3               # see fit_step_cost


# --- the ETA estimator: pure functions of plain data ---

@dataclass(slots=True)
class WorkLeft:
    """Unfinished sequences (running or waiting) and what finished ones showed."""

    generated: np.ndarray          # tokens generated so far, per unfinished sequence
    caps: np.ndarray               # max_tokens, per unfinished sequence
    prompt_tokens_left: int        # prompt positions still to compute
    stopped_lengths: np.ndarray    # lengths of finished sequences that stopped (EOS, stop)
    capped_lengths: np.ndarray     # lengths of finished sequences cut at max_tokens
    max_parallel: int = 1 << 30    # sequences that run side by side at most


@dataclass(slots=True)
class StepCosts:
    """Per engine step: seconds, generated tokens, prompt tokens computed."""

    seconds: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)

    def add(self, seconds: float, generated: int, prompt: int) -> None:
        self.seconds.append(seconds)
        self.generated.append(generated)
        self.prompt.append(prompt)


def fit_step_cost(costs: StepCosts) -> tuple[float, float, float] | None:
    """(seconds per step, per generated token, per prompt token) over the recent steps; None
    before there is anything to fit. Least squares on columns scaled to one size, with a small
    ridge: when steps all had the same batch (a full queue), the fixed and per-token parts
    cannot be told apart, and the ridge splits the cost evenly instead of at random. A
    negative part is noise: that term is dropped and the rest refitted."""
    if not costs.seconds:
        return None
    t = np.asarray(costs.seconds[-COST_WINDOW:], dtype=float)
    x = np.column_stack([np.ones_like(t), np.asarray(costs.generated[-COST_WINDOW:], float),
                         np.asarray(costs.prompt[-COST_WINDOW:], float)])
    scale = np.sqrt((x ** 2).mean(axis=0))
    active = [i for i in range(3) if scale[i] > 0]
    while active:
        z = x[:, active] / scale[active]
        ridge = RIDGE * len(t) * np.eye(len(active))
        coef = np.linalg.solve(z.T @ z + ridge, z.T @ t) / scale[active]
        if (coef >= 0).all():
            full = np.zeros(3)
            full[active] = coef
            return float(full[0]), float(full[1]), float(full[2])
        active.pop(int(np.argmin(coef)))
    return float(t.mean()), 0.0, 0.0


def survival(stopped: np.ndarray, censored: np.ndarray, horizon: int) -> np.ndarray:
    """S[t] = P(a sequence has not stopped after t tokens), t = 0..horizon (product-limit).

    A stopped length L is an event at L; a censored length c (still running, or cut at
    max_tokens) says only that the sequence ran past c. Beyond the longest length seen so far
    the curve goes on at the hazard of the recent half of what was seen (events per token at
    risk there): how fast sequences stopped lately is the best guess for those still running.
    With no event at all, S stays 1 (every sequence is assumed to reach its cap)."""
    t = np.arange(1, horizon + 1)
    stopped = np.asarray(stopped, dtype=np.int64)
    lengths = np.concatenate([stopped, np.asarray(censored, dtype=np.int64)])
    if stopped.size == 0:
        return np.ones(horizon + 1)
    at_risk = lengths.size - np.searchsorted(np.sort(lengths), t, side="left")
    events = np.bincount(np.clip(stopped, 0, horizon), minlength=horizon + 1)[1:]
    hazard = np.divide(events, at_risk, out=np.zeros(horizon), where=at_risk > 0)
    seen = int(lengths.max())
    recent = (t > seen // 2) & (t <= seen)
    hazard[t > seen] = events[recent].sum() / max(1, int(at_risk[recent].sum()))
    return np.concatenate([[1.0], np.cumprod(1.0 - np.clip(hazard, 0.0, 1.0))])


def tokens_and_steps_left(work: WorkLeft) -> tuple[float, float]:
    """Expected generated tokens still to come, and expected decode steps until the last one."""
    if work.generated.size == 0:
        return 0.0, 0.0
    horizon = int(work.caps.max())
    s = survival(work.stopped_lengths, np.concatenate([work.generated, work.capped_lengths]), horizon)
    k = np.arange(1, horizon + 1)                                  # k-th token from now
    g, caps = work.generated[:, None], work.caps[:, None]
    at = np.minimum(g + k[None, :] - 1, horizon)                   # S index: ran past g+k-1
    base = np.maximum(s[np.minimum(work.generated, horizon)], 1e-12)[:, None]
    p_more = np.where(g + k[None, :] <= caps, s[at] / base, 0.0)   # P(k-th further token comes)
    tokens = float(p_more.sum())
    all_done_by = np.exp(np.log1p(-np.clip(p_more, 0.0, 1.0 - 1e-12)).sum(axis=0))
    steps = float((1.0 - all_done_by).sum())                       # E[max over sequences]
    return tokens, max(steps, tokens / max(1, work.max_parallel))


def estimate_eta(costs: StepCosts, work: WorkLeft) -> float | None:
    """Seconds left, or None when no step has been timed yet."""
    fitted = fit_step_cost(costs)
    if fitted is None:
        return None
    per_step, per_token, per_prompt_token = fitted
    tokens, steps = tokens_and_steps_left(work)
    return per_step * steps + per_token * tokens + per_prompt_token * work.prompt_tokens_left


# --- what the engine has left (read from the engine's own objects) ---

def work_left(engine: Any, stopped: list[int], capped: list[int]) -> WorkLeft:
    """Running and waiting sequences; a waiting request with n > 1 counts its n samples."""
    scheduler = engine.scheduler
    generated, caps, prompt_left = [], [], 0
    for seq in list(scheduler.running) + list(scheduler.waiting):
        copies = seq.group.params.n if seq.group.needs_fork else 1
        generated += [seq.num_outputs] * copies
        caps += [seq.group.max_tokens] * copies
        prompt_left += max(0, seq.prompt_len - seq.num_computed)
    return WorkLeft(np.asarray(generated, dtype=np.int64), np.asarray(caps, dtype=np.int64),
                    prompt_left, np.asarray(stopped, dtype=np.int64),
                    np.asarray(capped, dtype=np.int64), engine.config.max_num_seqs)


# --- the display ---

@dataclass(slots=True)
class RunTotals:
    """The final line's figures (also written into the memory report's JSON)."""

    requests: int
    wall_s: float
    generated_tokens: int
    prompt_tokens: int
    peak_blocks: int
    num_blocks: int

    def as_dict(self) -> dict[str, Any]:
        wall = max(self.wall_s, 1e-9)
        return {"requests": self.requests, "wall_s": round(self.wall_s, 3),
                "generated_tokens": self.generated_tokens, "prompt_tokens": self.prompt_tokens,
                "generated_tok_per_s": round(self.generated_tokens / wall, 1),
                "prompt_tok_per_s": round(self.prompt_tokens / wall, 1),
                "peak_kv_blocks": self.peak_blocks, "num_blocks": self.num_blocks}

    def line(self) -> str:
        wall = max(self.wall_s, 1e-9)
        share = self.peak_blocks / max(1, self.num_blocks)
        return (f"{self.requests} requests in {self.wall_s:.1f} s: "
                f"{self.generated_tokens / wall:,.0f} generated tok/s, "
                f"{self.prompt_tokens / wall:,.0f} prompt tok/s; KV peak {self.peak_blocks:,} "
                f"of {self.num_blocks:,} blocks ({share:.1%})")


def stderr_console() -> Console:
    # soft_wrap: a plain line in a log stays one line, whatever width Rich guesses.
    return Console(stderr=True, soft_wrap=True)


class GenerationProgress:
    """Fed once per engine step by the caller; draws the bar and prints the final line."""

    def __init__(self, total: int, num_blocks: int, enabled: bool = True,
                 console: Console | None = None, clock: Callable[[], float] = time.perf_counter,
                 description: str = "generating") -> None:
        self.total, self.num_blocks, self.enabled = total, num_blocks, enabled
        self.console = console or stderr_console()
        self.clock, self.description = clock, description
        self.costs = StepCosts()
        self.done = 0
        self.generated = self.prompt = self.peak_blocks = self.blocks_used = 0
        self.stopped: list[int] = []
        self.capped: list[int] = []
        self.eta: float | None = None
        self.totals: RunTotals | None = None
        self._progress: Progress | None = None
        self._task: Any = None
        self._start = self._last_step = self._last_eta = self._last_plain = 0.0

    def __enter__(self) -> GenerationProgress:
        self._start = self._last_step = self._last_plain = self.clock()
        if self.enabled and self.console.is_terminal:
            self._progress = Progress(TextColumn(f"[bold]{self.description}"), BarColumn(),
                                      TextColumn("{task.fields[status]}"), console=self.console)
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total,
                                                 status=self.status())
        return self

    def finished(self, outputs: list[Any]) -> None:
        """Requests that came back (their samples' lengths teach the ETA when sequences stop)."""
        for out in outputs:
            self.done += 1
            for sample in getattr(out, "outputs", []):
                target = self.capped if sample.finish_reason == "length" else self.stopped
                target.append(len(sample.token_ids))

    def step(self, generated_total: int, prompt_total: int, blocks_used: int,
             work: Callable[[], WorkLeft] | None = None) -> None:
        """After each engine step: running totals of generated and prompt tokens, blocks used;
        `work` builds what is left (called only when the ETA is due)."""
        now = self.clock()
        self.costs.add(now - self._last_step, generated_total - self.generated,
                       prompt_total - self.prompt)
        self._last_step = now
        self.generated, self.prompt, self.blocks_used = generated_total, prompt_total, blocks_used
        self.peak_blocks = max(self.peak_blocks, blocks_used)
        if work is not None and now - self._last_eta >= ETA_EVERY_S:
            self.eta, self._last_eta = estimate_eta(self.costs, work()), now
        self._draw(now)

    def status(self) -> str:
        elapsed = max(self._last_step - self._start, 1e-9)
        eta = "ETA -:--" if self.eta is None else f"ETA {_clock(self.eta)}"
        return (f"{self.done}/{self.total} req  {self.generated / elapsed:,.0f} gen tok/s  "
                f"{self.prompt / elapsed:,.0f} prompt tok/s  "
                f"KV {self.blocks_used / max(1, self.num_blocks):.1%}  {eta}")

    def _draw(self, now: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, status=self.status())
        elif self.enabled and now - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = now
            self.console.print(f"{self.description} {self.status()}", highlight=False)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, status=self.status())
            self._progress.stop()
        self.totals = RunTotals(self.done, self.clock() - self._start, self.generated,
                                self.prompt, self.peak_blocks, self.num_blocks)
        if self.enabled and exc_type is None:
            self.console.print(self.totals.line(), highlight=False)


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


# --- the load line ---

def describe_model_file(path: Path, kind: str) -> str:
    """"name (98.2 MB, GGUF)": the file or folder, its size on disk, its format."""
    files = [path] if path.is_file() else [p for p in path.glob("*.safetensors")]
    size = sum(p.stat().st_size for p in files if p.is_file())
    return f"{path.name} ({size / 1e6:,.1f} MB, {'GGUF' if kind == 'gguf' else 'safetensors'})"


@contextmanager
def loading_status(what: str, device: str, enabled: bool = True,
                   console: Console | None = None) -> Iterator[None]:
    """"loading X on cpu ... loaded in 2.1 s": a spinner on a terminal, one line elsewhere."""
    console = console or stderr_console()
    start = time.perf_counter()
    message = f"loading {what} on {device}"
    if not enabled:
        yield
        return
    if console.is_terminal:
        with console.status(message + " ..."):
            yield
    else:
        yield
    console.print(f"{message} ... loaded in {time.perf_counter() - start:.1f} s", highlight=False)

