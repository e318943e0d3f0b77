"""Continuous batching: which tokens of which sequences run in the next step.

Each step fills a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):
running decodes first (one token each), then pending prefill chunks of running sequences, then
new sequences from the waiting queue (first come, first served). A prompt longer than what is
left of the budget is prefilled in chunks over several steps.

When the KV pool cannot give a sequence its blocks, the most recently admitted running group is
preempted by recompute: its blocks are freed and its sequences go back to the front of the
waiting queue (prefix caching makes the re-prefill cheap). Sequences already scheduled in this
step are never preempted: their freshly appended blocks may carry prefix hashes for K/V that
only this step's forward will write. If the newest group has such members, the newest
unscheduled sequence is preempted instead (possibly the one asking), which also keeps a
group that cannot fit whole from preempting itself forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.engine.sequence import Sequence, SeqStatus
from pagedgen.model.runtime.batch import ScheduledChunk
from pagedgen.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence]                 # in batch order, one per chunk
    chunks: list[ScheduledChunk]
    copies: list[tuple[int, int]]        # copy-on-write pairs for runner.execute
    preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(slots=True)
class SchedulerStats:
    preemptions: int = 0                 # sequences preempted (each one re-prefills later)
    recomputed_tokens: int = 0           # tokens computed again after a preemption
    prompt_tokens_computed: int = 0      # prompt positions computed (prefix hits excluded)
    admissions: int = 0


@dataclass(slots=True)
class _StepState:
    budget: int
    scheduled: dict[int, int] = field(default_factory=dict)   # seq_id -> position in output
    output: SchedulerOutput = field(default_factory=lambda: SchedulerOutput([], [], []))


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        check_step_budget(max_num_seqs, max_num_batched_tokens)
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # admission order; forked siblings next to each other
        self.stats = SchedulerStats()

    # --- queue management ---
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Zero-copy fork of a running sequence into siblings placed right after it."""
        for child in children:
            self.kv.fork(parent.seq_id, child.seq_id)
        at = self.running.index(parent) + 1
        self.running[at:at] = children

    def finish(self, seqs: list[Sequence]) -> None:
        """Frees finished sequences' blocks and drops them from the running list."""
        for seq in seqs:
            seq.status = SeqStatus.FINISHED
            self.kv.free(seq.seq_id)
        if seqs:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]

    # --- one step ---
    def schedule(self) -> SchedulerOutput:
        state = _StepState(self.max_num_batched_tokens)
        decodes = [s for s in self.running if s.num_pending == 1]
        prefills = [s for s in self.running if s.num_pending > 1]
        for seq in decodes + prefills:
            if state.budget == 0:
                break
            if seq.status is SeqStatus.RUNNING:
                self._schedule_running(seq, state)
        if state.output.preempted == 0:  # re-admitting in a preempting step would just thrash
            self._admit_waiting(state)
        state.output.copies = self.kv.take_pending_copies()
        return state.output

    def _schedule_running(self, seq: Sequence, state: _StepState) -> None:
        num_tokens = min(seq.num_pending, state.budget)
        while not self._fits(seq, num_tokens):
            victims = self._pick_victims(seq, state)
            self._preempt(victims, state)
            if seq in victims:
                return
        self._emit(seq, num_tokens, state)

    def _fits(self, seq: Sequence, num_tokens: int) -> bool:
        """Can `seq` append num_tokens now? Most decode steps need no new block and no copy:
        one per-sequence count answers them; the general check (built for groups of sequences,
        several times the cost, paid for every running sequence every step) runs only when
        blocks are needed."""
        return (self.kv.blocks_to_append(seq.seq_id, num_tokens) == 0
                or self.kv.can_append([seq.seq_id], num_tokens))

    def _admit_waiting(self, state: _StepState) -> None:
        while self.waiting and state.budget > 0:
            seq = self.waiting[0]
            if self.running and len(self.running) + seq.group.seats > self.max_num_seqs:
                break
            cached = self.kv.num_cached_prefix_tokens(seq.token_ids)
            num_tokens = min(len(seq.token_ids) - cached, state.budget)
            if not self.kv.can_admit(seq.token_ids, num_tokens):
                break
            self.waiting.popleft()
            self._admit(seq)
            self._emit(seq, num_tokens, state)

    def _admit(self, seq: Sequence) -> None:
        seq.num_computed = self.kv.admit(seq.seq_id, seq.token_ids)
        if seq.group.cached_prompt_tokens is None:
            seq.group.cached_prompt_tokens = seq.num_computed
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.stats.admissions += 1

    def _emit(self, seq: Sequence, num_tokens: int, state: _StepState) -> None:
        """Reserves the slots of the next num_tokens tokens (checked to fit) and schedules them."""
        start = seq.num_computed
        end = start + num_tokens
        token_ids = seq.token_ids[start:end]
        self.kv.append_slots(seq.seq_id, token_ids)
        chunk = ScheduledChunk(
            token_ids=token_ids, start_pos=start,
            block_table=self.kv.block_table(seq.seq_id), sample=end == len(seq.token_ids))
        self._count(seq, start, end)
        seq.num_computed = end   # advanced now: the runner computes exactly these tokens
        state.scheduled[seq.seq_id] = len(state.output.chunks)
        state.output.seqs.append(seq)
        state.output.chunks.append(chunk)
        state.budget -= num_tokens

    def _count(self, seq: Sequence, start: int, end: int) -> None:
        stats = self.stats
        stats.recomputed_tokens += max(0, min(end, seq.high_water) - start)
        stats.prompt_tokens_computed += max(0, min(end, seq.prompt_len) - start)
        seq.high_water = max(seq.high_water, end)

    # --- preemption ---
    def _pick_victims(self, seq: Sequence, state: _StepState) -> list[Sequence]:
        newest_group = self.running[-1].group
        if newest_group is not seq.group:
            members = [s for s in self.running if s.group is newest_group]
            if not any(s.seq_id in state.scheduled for s in members):
                return members
        # The asking sequence is itself unscheduled, so this always finds one.
        return [next(s for s in reversed(self.running) if s.seq_id not in state.scheduled)]

    def _preempt(self, victims: list[Sequence], state: _StepState) -> None:
        for victim in victims:
            self.kv.free(victim.seq_id)
            victim.num_computed = 0
            victim.status = SeqStatus.WAITING
        self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        self.waiting.extendleft(reversed(victims))  # front of the queue, in their order
        self.stats.preemptions += len(victims)
        state.output.preempted += len(victims)


def check_step_budget(max_num_seqs: int, max_num_batched_tokens: int) -> None:
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
            f"({max_num_seqs}): every running sequence needs one token of the step budget")


def rejection_reason(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                     block_size: int, num_blocks: int, vocab_size: int | None) -> str | None:
    """Why a request can never be served (None when it can); the text says what to change.

    Checked once, before queueing: everything admitted can then complete, if need be after
    preemptions, because one sequence alone always fits the pool."""
    n = len(prompt_token_ids)
    if n == 0:
        return "prompt is empty; give at least one token"
    if n >= max_model_len:
        return (f"prompt has {n} tokens but max_model_len is {max_model_len} (no room for a new "
                "token); raise --max-model-len or shorten the prompt")
    if vocab_size is not None and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):
        return f"prompt token ids must be in [0, {vocab_size}) for this model"
    max_tokens = min(params.max_tokens, max_model_len - n)
    # The last generated token is returned but never stored, hence the - 1.
    needed = -(-(n + max_tokens - 1) // block_size)
    if needed > num_blocks:
        return (f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {needed} KV blocks of "
                f"{block_size} tokens but the pool has only {num_blocks}; raise --kv-memory or "
                "--num-blocks, or lower max_tokens / --max-model-len")
    return None
