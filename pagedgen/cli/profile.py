"""`pagedgen profile`: one workload, once per block size, same KV bytes, timed per engine phase.

The engine offers the timing hook (LLMEngine.set_phase_hook); PhaseTimer is what it calls:

- scheduling  = the scheduler's pick of the step's batch
- forward     = the runner's forward, split into attention (the kernel backend's store_kv,
                paged_attention and plan_attention) and the rest
- sampling    = the sampler
- bookkeeping = the rest of the step (batch assembly for the sampler, appending tokens,
                stop checks, freeing, the memory tracker)

On CUDA every timer synchronizes the device before reading the clock, so GPU work is counted
in the phase that launched it (which also serializes the launches: profile numbers are a
breakdown, not peak throughput).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedgen.settings import default

PHASES = ("scheduling", "forward", "attention", "sampling", "step")


@dataclass(slots=True)
class PhaseTimer:
    device: torch.device
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.totals:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - start
            self.steps += name == "step"

    def reset(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    def mean_ms(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase; 'bookkeeping' is what the others leave."""
        t, n = self.totals, max(self.steps, 1)
        parts = {"scheduling": t["scheduling"], "attention": t["attention"],
                 "forward_other": t["forward"] - t["attention"], "sampling": t["sampling"]}
        parts["bookkeeping"] = t["step"] - t["scheduling"] - t["forward"] - t["sampling"]
        parts["step"] = t["step"]
        return {k: 1e3 * v / n for k, v in parts.items()}


def instrument(llm: Any) -> PhaseTimer:
    """Turn the engine's phase timing on, into a fresh PhaseTimer."""
    timer = PhaseTimer(torch.device(llm.engine.device))
    llm.engine.set_phase_hook(timer)
    return timer


# --- workload ---

@dataclass(slots=True)
class WorkItem:
    request_id: str
    prompt_token_ids: list[int]
    params: Any    # SamplingParams


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'32..256' -> (32, 256); '64' -> (64, 64). ValueError names the option."""
    low, sep, high = str(text).partition("..")
    try:
        bounds = (int(low), int(high if sep else low))
    except ValueError:
        raise ValueError(f"{name} must be N or MIN..MAX with integers, got {text!r}") from None
    if bounds[0] < 1 or bounds[0] > bounds[1]:
        raise ValueError(f"{name} must satisfy 1 <= MIN <= MAX, got {text!r}")
    return bounds


def synthetic_workload(num_requests: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int],
                       seed: int, vocab_size: int) -> list[WorkItem]:
    """Random prompts of mixed lengths; ignore_eos so every request generates exactly max_tokens."""
    from pagedgen.engine.sampling_params import SamplingParams

    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    items = []
    for i in range(num_requests):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))]
        params = SamplingParams(temperature=1.0, seed=seed + i, ignore_eos=True,
                                max_tokens=rng.randint(*max_tokens))
        items.append(WorkItem(f"synthetic-{i}", prompt, params))
    return items


def file_workload(path: str, llm: Any, sampling_defaults: dict[str, Any]) -> tuple[list[WorkItem], int]:
    """Requests of a JSONL file, tokenized for this model; (items, lines skipped as invalid)."""
    from pagedgen.jobs.input_records import Request, read_requests
    from pagedgen.jobs.prepare import prepare

    items, skipped = [], 0
    for entry in read_requests(path, sampling_defaults):
        try:
            if not isinstance(entry, Request):
                raise ValueError(entry)
            prepared = prepare(entry, llm)
        except ValueError:
            skipped += 1
            continue
        items.append(WorkItem(entry.key, prepared.token_ids, prepared.params))
    return items, skipped


def warmup_workload(items: Sequence[WorkItem], vocab_size: int) -> list[WorkItem]:
    """A few short requests of fresh random tokens: they warm kernels without seeding the
    prefix cache with the measured prompts."""
    from pagedgen.engine.sampling_params import SamplingParams

    rng = random.Random(-1)
    return [WorkItem(f"warmup-{i}", [rng.randrange(vocab_size) for _ in range(min(32, len(it.prompt_token_ids)))],
                     SamplingParams(temperature=1.0, seed=i, ignore_eos=True, max_tokens=4))
            for i, it in enumerate(items[:4])]


# --- one block size ---

@dataclass(slots=True)
class ProfileRow:
    block_size: int
    num_blocks: int
    pool_bytes: int
    requests: int
    wall_s: float
    steps: int
    generated_tokens: int
    prompt_tokens: int                 # prompt positions computed (prefix-cache hits excluded)
    generated_tokens_per_s: float
    prompt_tokens_per_s: float
    step_ms: dict[str, float]          # mean per step: scheduling, attention, forward_other, ...
    peak_blocks_used: int
    kv_utilization_at_peak: float
    internal_fragmentation_at_peak: float
    peak_concurrent_sequences: int
    preemptions: int
    failed_requests: int
    kv_cache_dtype: str = default("kv_cache_dtype")
    first_failure: str | None = None   # why the first failed request failed
    bytes_per_token: int = 0           # of the KV pool, scales included
    kv_groups: dict[str, Any] | None = None  # a hybrid pool: the report's kv_groups section
    prefix_store: dict[str, Any] | None = None  # --prefix-store: what it served and wrote here


def _generate(llm: Any, items: Sequence[WorkItem], on_done: Callable[[], None]) -> list[Any]:
    return llm.generate([{"prompt_token_ids": it.prompt_token_ids} for it in items],
                        [it.params for it in items], use_tqdm=False,
                        on_output=lambda _out: on_done(), request_ids=[it.request_id for it in items])


def _counter_delta(after: Any, before: Any) -> Any:
    return type(after)(**{f.name: getattr(after, f.name) - getattr(before, f.name)
                          for f in dataclasses.fields(after)})


def profile_llm(llm: Any, items: Sequence[WorkItem], on_done: Callable[[], None] = lambda: None) -> ProfileRow:
    """Warm up, then run `items` once with the phase timers on."""
    from pagedgen.memory.report import build_report

    vocab = llm.loaded.config.vocab_size
    _generate(llm, warmup_workload(items, vocab), lambda: None)
    timer = instrument(llm)
    llm.engine.reset_tracker()  # the measured run gets its own memory history, without the warm-up
    stats_before = dict(llm.stats)
    counters_before = dataclasses.replace(llm.engine.kv.counters)
    store_before = _store_report(llm)
    start = time.perf_counter()
    outputs = _generate(llm, items, on_done)
    wall = time.perf_counter() - start
    store = _store_delta(_store_report(llm), store_before)
    stats = {k: v - stats_before[k] for k, v in llm.stats.items()}
    report = build_report(llm.tracker, _counter_delta(llm.engine.kv.counters, counters_before))
    summary = report["summary"]
    runner = llm.runner
    return ProfileRow(
        runner.block_size, runner.num_blocks, runner.kv_cache_bytes, len(items), wall, timer.steps,
        stats["generated_tokens"], stats["prompt_tokens_computed"],
        stats["generated_tokens"] / wall, stats["prompt_tokens_computed"] / wall, timer.mean_ms(),
        summary["peak_blocks_used"], summary["kv_utilization_at_peak"],
        summary["internal_fragmentation_at_peak"], summary["peak_concurrent_sequences"],
        stats["preemptions"], sum(1 for o in outputs if o.error),
        kv_cache_dtype=runner.kv_cache_dtype, bytes_per_token=runner.kv_bytes_per_token,
        kv_groups=report.get("kv_groups"), prefix_store=store,
        first_failure=next((o.error for o in outputs if o.error), None))


def _store_report(llm: Any) -> dict[str, Any] | None:
    store = llm.engine.store
    return None if store is None else dataclasses.asdict(store.report())


def _store_delta(after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any] | None:
    """The store's counters over the measured run only (the warm-up reads and writes too)."""
    if after is None:
        return None
    return {k: v - before[k] if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in after.items()}


# --- several block sizes, side by side ---

@dataclass(slots=True)
class WorkloadSpec:
    path: str | None = None                      # JSONL file, or None for the synthetic workload
    num_requests: int = 64
    prompt_len: tuple[int, int] = (32, 256)
    max_tokens: tuple[int, int] = (32, 256)
    seed: int = default("seed")                  # the run config's seed (--seed)


def _workload(spec: WorkloadSpec, llm: Any, sampling: dict[str, Any]) -> tuple[list[WorkItem], dict[str, Any]]:
    if spec.path is None:
        items = synthetic_workload(spec.num_requests, spec.prompt_len, spec.max_tokens, spec.seed,
                                   llm.loaded.config.vocab_size)
        return items, {"source": "synthetic", **dataclasses.asdict(spec)}
    items, skipped = file_workload(spec.path, llm, sampling)
    if not items:
        raise ValueError(f"{spec.path}: no valid request to profile ({skipped} invalid lines)")
    return items, {"source": spec.path, "skipped_lines": skipped}


def _progress_callback(progress: Any, block_size: int, total: int) -> Callable[[], None]:
    if progress is None:
        return lambda: None
    task = progress.add_task(f"block size {block_size}", total=total)
    return lambda: progress.advance(task)


def run_profile(config: Any, block_sizes: Sequence[int], spec: WorkloadSpec,
                build_llm: Callable[[Any], Any], progress: Any = None) -> dict[str, Any]:
    """config: a RunConfig. The first block size sizes the pool (kv_memory, num_blocks or the
    default); every other block size gets the same pool in bytes."""
    rows, items, workload, pool_bytes = [], None, None, None
    for block_size in block_sizes:
        sized = {"kv_memory": pool_bytes, "num_blocks": None} if pool_bytes else {}
        engine = dataclasses.replace(config.engine, block_size=block_size, **sized)
        llm = build_llm(dataclasses.replace(config, engine=engine))
        if items is None:
            items, workload = _workload(spec, llm, config.sampling)
        row = profile_llm(llm, items, _progress_callback(progress, block_size, len(items)))
        if row.failed_requests == len(items):   # nothing was measured: timings would mislead
            raise ValueError(f"every request of the workload failed at block size {block_size}, "
                             f"so there is nothing to profile; the first: {row.first_failure}")
        rows.append(row)
        pool_bytes = pool_bytes or llm.runner.kv_cache_bytes
        del llm   # free the pool before the next block size allocates its own
    totals = {"requests": len(items),
              "total_prompt_tokens": sum(len(i.prompt_token_ids) for i in items),
              "total_max_tokens": sum(i.params.max_tokens * i.params.n for i in items)}
    return {"kind": PROFILE_KIND, "workload": workload | totals,
            "rows": [dataclasses.asdict(r) for r in rows]}


# --- --json: the run's path rules ---

PROFILE_KIND = "pagedgen profile"


def written_by_profile(path: Any) -> bool:
    """A results file of an earlier `pagedgen profile --json` (its own kind, or the shape of
    one written before the kind was recorded)."""
    import json

    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(1 << 24))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and (data.get("kind") == PROFILE_KIND
                                       or set(data) == {"workload", "rows"})


def check_json_target(path: Any, inputs: list[tuple[str, Any]]) -> None:
    """Before profiling: --json must be a file that may be written (jobs/paths.py's rules)."""
    from pathlib import Path

    from pagedgen.jobs.paths import check_single_target

    check_single_target("--json file", Path(path), [(w, Path(p)) for w, p in inputs if p is not None],
                        written_by_profile)


def write_json(path: Any, result: dict[str, Any]) -> None:
    """Atomically (a temporary file renamed), so a failure never leaves half a file."""
    import json

    from pagedgen.jobs.output_files import write_atomically

    write_atomically(path, [(json.dumps(result, indent=2) + "\n").encode()])


STEP_PARTS = (("scheduling", "scheduling"), ("attention", "forward: attention"),
              ("forward_other", "forward: rest"), ("sampling", "sampling"),
              ("bookkeeping", "bookkeeping"), ("step", "step total"))


def profile_table(result: dict[str, Any]) -> Any:
    """Block sizes side by side, one metric per row."""
    from rich.table import Table

    rows = result["rows"]
    table = Table(title="pagedgen profile (mean per engine step, same KV pool bytes)", title_justify="left")
    table.add_column("metric", style="bold")
    for r in rows:
        table.add_column(f"B = {r['block_size']}", justify="right")

    def add(label: str, fmt: Callable[[dict[str, Any]], str]) -> None:
        table.add_row(label, *(fmt(r) for r in rows))

    add("blocks in pool", lambda r: f"{r['num_blocks']:,} ({r['pool_bytes'] / 2**20:,.1f} MiB)")
    add("KV cache dtype", lambda r: f"{r.get('kv_cache_dtype', 'auto')} "
                                    f"({r.get('bytes_per_token', 0):,} B/token)")
    add("generated tokens/s", lambda r: f"{r['generated_tokens_per_s']:,.1f}")
    add("prompt tokens/s", lambda r: f"{r['prompt_tokens_per_s']:,.1f}")
    add("wall time", lambda r: f"{r['wall_s']:.2f} s ({r['steps']} steps)")
    for key, label in STEP_PARTS:
        add(f"{label} (ms)", lambda r, key=key: f"{r['step_ms'][key]:.3f}")
    add("peak blocks used", lambda r: f"{r['peak_blocks_used']:,}")
    add("KV utilization at peak", lambda r: f"{100 * r['kv_utilization_at_peak']:.1f}%")
    add("internal fragmentation at peak", lambda r: f"{100 * r['internal_fragmentation_at_peak']:.1f}%")
    add("peak concurrent sequences", lambda r: str(r["peak_concurrent_sequences"]))
    add("preemptions", lambda r: str(r["preemptions"]))
    add("failed requests", lambda r: str(r["failed_requests"]))
    if any(r.get("kv_groups") for r in rows):
        _add_group_rows(add, rows)
    if any(r.get("prefix_store") for r in rows):
        _add_store_rows(add)
    reasons = {r["first_failure"] for r in rows if r.get("first_failure")}
    if reasons:
        table.caption = "first failure: " + "; ".join(sorted(reasons))
    return table


def _add_group_rows(add: Callable[..., None], rows: list[dict[str, Any]]) -> None:
    """A hybrid pool: each layer group's pages at the peak, and every layer full attention."""
    def group(r: dict[str, Any], index: int) -> dict[str, Any]:
        return r["kv_groups"]["groups"][index]

    for index, first in enumerate(rows[0]["kv_groups"]["groups"]):
        kind = f"window {first['window']:,}" if first["window"] else "full"
        add(f"group {index} ({kind}, {first['layers']} layers): peak blocks / freed by window",
            lambda r, i=index: f"{group(r, i)['blocks_used_at_peak']:,} / "
                               f"{group(r, i)['blocks_released_by_window']:,}")
    add("peak KV bytes / every layer full attention",
        lambda r: f"{r['kv_groups']['peak_bytes'] / 2**20:,.1f} / "
                  f"{r['kv_groups']['full_attention']['peak_bytes'] / 2**20:,.1f} MiB "
                  f"({100 * r['kv_groups']['peak_fraction_of_full_attention']:.0f}%)")


def _add_store_rows(add: Callable[..., None]) -> None:
    """--prefix-store: what the store served and took during the measured run."""
    def store(r: dict[str, Any]) -> dict[str, Any]:
        return r.get("prefix_store") or {}

    add("prompt tokens read from the store", lambda r: f"{store(r).get('hit_tokens', 0):,}")
    add("store MiB read / written", lambda r: f"{store(r).get('bytes_read', 0) / 2**20:,.1f} / "
                                              f"{store(r).get('bytes_written', 0) / 2**20:,.1f}")
    add("prefill time saved by the store", lambda r: f"{store(r).get('prefill_seconds_saved', 0):.2f} s")
    add("store writes dropped", lambda r: f"{store(r).get('writes_dropped', 0):,}"
                                          + (f" ({store(r)['write_stopped']})" if store(r).get("write_stopped") else ""))
