"""The memory tracker: samples the KV pool after every engine step (contract section 6).

Per step the work is O(running sequences) and the memory stays bounded: the timeline keeps
every k-th step (k doubles as the run grows) plus the peak. The block tables (O(blocks) to
copy) are captured only when blocks_used reaches a new peak and at a few evenly spaced steps
for `inspect-memory --step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pagedgen.settings import default
from pagedgen.validation import require_int
from pagedgen.memory.counterfactual import CounterfactualReplay
from pagedgen.memory.sampled_series import SampledSeries
from pagedgen.engine.seq_info import SeqMemInfo

if TYPE_CHECKING:
    from pagedgen.engine.kv_types import PoolSnapshot

__all__ = ["MemoryTracker", "SeqMemInfo", "StepSample", "TableSnapshot"]


@dataclass(slots=True)
class StepSample:
    """One point of the timeline; reservations are the counterfactual policies' slots."""
    step: int
    blocks_used: int
    blocks_shared: int
    blocks_cached_free: int
    logical_blocks: int
    tokens_stored: int
    running: int
    waiting: int
    preemptions: int
    recomputed_tokens: int
    static_max_model_len_tokens: int
    static_request_tokens: int
    dynamic_doubling_tokens: int


@dataclass(slots=True)
class TableSnapshot:
    """Block tables at one step, stored raw: ref counts are derived when the report is built
    (a block's ref count is the number of table entries holding it, the manager's invariant),
    so that capturing at every new peak costs only list copies."""
    step: int
    sample: StepSample
    tables: dict[int, list[int]]
    running: dict[int, SeqMemInfo]
    cached_free_blocks: list[int] | None   # None: the caller could not say which blocks


@dataclass(slots=True)
class UtilizationMean:
    total: float = 0.0
    steps: int = 0

    def add(self, tokens_stored: int, slots: int) -> None:
        if slots > 0:   # an empty pool has no utilization to speak of
            self.total += tokens_stored / slots
            self.steps += 1

    @property
    def value(self) -> float:
        return self.total / self.steps if self.steps else 0.0


def _cached_ids(count: int, cached_free_blocks: Callable[[], list[int]] | None) -> list[int] | None:
    if cached_free_blocks is None:
        return None
    # Under pressure (at a peak) there often are none: skip even the O(cached) walk.
    return sorted(cached_free_blocks()) if count else []


def capture_tables(step: int, sample: StepSample, running: Sequence[SeqMemInfo],
                   block_tables: Callable[[], dict[int, list[int]]],
                   cached_free_blocks: Callable[[], list[int]] | None) -> TableSnapshot:
    # SeqMemInfo objects are copied: the engine may reuse them for the next step.
    infos = {seq.seq_id: SeqMemInfo(seq.seq_id, seq.request_id, seq.sample_index, seq.num_tokens,
                                    seq.prompt_tokens, seq.max_tokens) for seq in running}
    cached = _cached_ids(sample.blocks_cached_free, cached_free_blocks)
    return TableSnapshot(step, sample, block_tables(), infos, cached)


@dataclass(slots=True)
class MemoryTracker:
    block_size: int
    num_blocks: int
    bytes_per_token: int
    dtype: str
    max_model_len: int
    max_timeline_points: int = 2000
    max_table_snapshots: int = 16
    # The model's KV shape, optional: only the address translation of inspect-memory needs it.
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    kv_cache_dtype: str = default("kv_cache_dtype")   # "auto" or an 8-bit format: 1-byte codes + per-block scales
    # A hybrid pool (model/runtime/kv_groups.py): per layer group its window (0 = full) and its
    # layers; bytes_per_token and num_layers then describe one page (G layers). Empty: one group.
    group_windows: tuple[int, ...] = ()
    group_layers: tuple[int, ...] = ()
    # K/V bytes of one token in every layer (the "every layer full attention" counterfactual and
    # the static reservations); None: bytes_per_token (a one-group pool).
    full_attention_bytes_per_token: int | None = None
    timeline: SampledSeries[StepSample] = field(init=False)
    table_snapshots: SampledSeries[TableSnapshot] = field(init=False)
    replay: CounterfactualReplay = field(init=False)
    utilization: UtilizationMean = field(default_factory=UtilizationMean, init=False)
    peak: StepSample | None = field(default=None, init=False)
    peak_tables: TableSnapshot | None = field(default=None, init=False)
    # The step where the tables, unshared (every branch holding its whole prefix), were largest.
    peak_logical: StepSample | None = field(default=None, init=False)
    last: StepSample | None = field(default=None, init=False)
    peak_running: int = field(default=0, init=False)
    peak_running_step: int = field(default=-1, init=False)
    paging_slot_steps: int = field(default=0, init=False)   # sum over steps of allocated slots
    peak_groups: tuple = field(default=(), init=False)       # GroupSnapshots at the peak step
    last_groups: tuple = field(default=(), init=False)
    # The most pages the pool would have held had no window released any (at its step).
    peak_full_attention_blocks: int = field(default=0, init=False)
    peak_full_attention_step: int = field(default=-1, init=False)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "bytes_per_token", "max_model_len",
                     "max_timeline_points", "max_table_snapshots"):
            require_int(f"MemoryTracker.{name}", getattr(self, name))
        self._check_layout()
        self.timeline = SampledSeries(self.max_timeline_points)
        self.table_snapshots = SampledSeries(self.max_table_snapshots)
        self.replay = CounterfactualReplay(self.max_model_len, self.num_blocks * self.block_size)

    def _check_layout(self) -> None:
        shape = (self.num_layers, self.num_kv_heads, self.head_dim)
        if shape == (None, None, None):
            return
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            require_int(f"MemoryTracker.{name}", getattr(self, name))
        elements = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        if self.kv_cache_dtype == "auto" and self.bytes_per_token % elements:
            raise ValueError(f"MemoryTracker: bytes_per_token={self.bytes_per_token} is not a multiple "
                             f"of 2 x num_layers x num_kv_heads x head_dim = {elements}")

    def reset(self) -> None:
        """Forget everything recorded; the pool's description stays."""
        fresh = replace(self)
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    @property
    def layout(self) -> dict[str, int] | None:
        if self.num_layers is None:
            return None
        elements = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        layout = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                  "head_dim": self.head_dim, "dtype_bytes": self.bytes_per_token // elements}
        if self.kv_cache_dtype != "auto":  # 1-byte codes; float32 scales [L, 2, N, H_kv] beside
            layout |= {"dtype_bytes": 1, "kv_cache_dtype": self.kv_cache_dtype, "scale_bytes": 4}
        return layout

    @property
    def steps_recorded(self) -> int:
        return self.timeline.offered

    def record(self, step: int, snapshot: PoolSnapshot, running: Sequence[SeqMemInfo],
               num_waiting: int, preemptions: int, recomputed_tokens: int,
               block_tables: Callable[[], dict[int, list[int]]],
               ref_count: Callable[[int], int] | None = None,
               cached_free_blocks: Callable[[], list[int]] | None = None) -> None:
        """Called by the engine after every step. preemptions / recomputed_tokens are the
        engine's running totals (cumulative), so a sampled timeline loses nothing.
        block_tables() (fresh lists) and cached_free_blocks() (ids of ref-0 blocks still
        hashed; optional) are called only at a new peak and at sampled snapshot steps.
        ref_count is not called: a block's ref count is the number of table entries holding
        it (the manager's invariant, checked by the tests), and counting those when the report
        is built costs nothing per step, where a call per block at every peak would not."""
        if snapshot.num_blocks != self.num_blocks:
            raise ValueError(f"snapshot.num_blocks={snapshot.num_blocks} but the tracker was "
                             f"built for num_blocks={self.num_blocks}")
        sample = self._sample(step, snapshot, running, num_waiting, preemptions, recomputed_tokens)
        slots = snapshot.blocks_used * self.block_size
        self.utilization.add(snapshot.tokens_stored, slots)
        self.paging_slot_steps += slots
        is_peak = self.peak is None or sample.blocks_used > self.peak.blocks_used
        self._keep_tables(sample, is_peak, lambda: capture_tables(
            step, sample, running, block_tables, cached_free_blocks))
        self.timeline.append(sample, pinned=is_peak)
        if self.peak_logical is None or sample.logical_blocks > self.peak_logical.logical_blocks:
            self.peak_logical = sample
        self._track_concurrency(step, len(running))
        self.last = sample
        if snapshot.groups:
            self._track_groups(step, snapshot, is_peak)

    def _track_groups(self, step: int, snapshot: PoolSnapshot, is_peak: bool) -> None:
        if is_peak:
            self.peak_groups = snapshot.groups
        self.last_groups = snapshot.groups
        unreleased = snapshot.blocks_used + sum(g.released_entries for g in snapshot.groups)
        if unreleased > self.peak_full_attention_blocks:
            self.peak_full_attention_blocks, self.peak_full_attention_step = unreleased, step

    @property
    def token_bytes_all_layers(self) -> int:
        """K/V bytes of one token in every layer (= bytes_per_token for a one-group pool)."""
        return self.full_attention_bytes_per_token or self.bytes_per_token

    def _keep_tables(self, sample: StepSample, is_peak: bool, capture: Callable[[], TableSnapshot]) -> None:
        if is_peak:
            self.peak = sample
            self.peak_tables = capture()
        if not self.table_snapshots.wants():
            self.table_snapshots.skip()   # off the grid: not worth calling block_tables()
            return
        self.table_snapshots.append(self.peak_tables if is_peak else capture())

    def _sample(self, step: int, snapshot: PoolSnapshot, running: Sequence[SeqMemInfo],
                num_waiting: int, preemptions: int, recomputed_tokens: int) -> StepSample:
        reserved = self.replay.update(step, running)
        return StepSample(
            step, snapshot.blocks_used, snapshot.blocks_shared, snapshot.blocks_cached_free,
            snapshot.logical_blocks, snapshot.tokens_stored, len(running), num_waiting,
            preemptions, recomputed_tokens, reserved.static_max_model_len,
            reserved.static_request, reserved.dynamic_doubling)

    def _track_concurrency(self, step: int, running: int) -> None:
        if running > self.peak_running:
            self.peak_running, self.peak_running_step = running, step

    def snapshot_at(self, step: int) -> TableSnapshot | None:
        """The block tables recorded at this step, if that step was kept."""
        if self.peak_tables is not None and self.peak_tables.step == step:
            return self.peak_tables
        return next((s for s in self.table_snapshots.items() if s.step == step), None)
