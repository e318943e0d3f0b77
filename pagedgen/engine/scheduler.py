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

Beam search groups step together: their live beams are scheduled all in one step or not at all,
and are preempted together. Back from a preemption, each beam is re-prefilled up to its last
token, which waits until every beam of the group is back (`_held_back`). If nothing at all can
run because partly re-admitted groups fill the pool, the newest one is sent back behind the
others (`_unstick`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedgen.settings import check_step_budget
from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.engine.sequence import Sequence, SequenceGroup, SeqStatus
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

    def drop_all(self) -> list[Sequence]:
        """Empties both queues without touching the KV manager (the caller recounts it: see
        KVCacheManager.abort); returns the dropped sequences."""
        dropped = [*self.running, *self.waiting]
        for seq in dropped:
            seq.status = SeqStatus.FINISHED
        self.running, self.waiting = [], deque()
        return dropped

    def park(self, seqs: list[Sequence]) -> None:
        """Takes finished sequences off the running list but keeps their blocks (tree nodes)."""
        for seq in seqs:
            seq.status = SeqStatus.FINISHED
        if seqs:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]

    def start_running(self, seq: Sequence) -> None:
        """Runs a sequence whose blocks the KV manager already holds (a branch of a kept one)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

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
            if seq.status is SeqStatus.RUNNING and seq.seq_id not in state.scheduled:
                if seq.group.beam is not None and seq.num_pending == 1:
                    self._schedule_beam_step(seq.group, state)
                else:
                    self._schedule_running(seq, state)
        if state.output.preempted == 0:  # re-admitting in a preempting step would just thrash
            self._admit_waiting(state)
        if not state.output.chunks and self.running:
            self._unstick(state)
        state.output.copies = self.kv.take_pending_copies()
        return state.output

    def _schedule_running(self, seq: Sequence, state: _StepState) -> None:
        num_tokens = min(seq.num_pending - _held_back(seq), state.budget)
        if num_tokens <= 0:
            return
        while not self._fits(seq, num_tokens):
            victims = self._pick_victims(seq, state)
            self._preempt(victims, state)
            if seq in victims:
                return
        self._emit(seq, num_tokens, state)

    def _schedule_beam_step(self, group: SequenceGroup, state: _StepState) -> None:
        """A beam search step needs every live beam's next-token row in the same batch: all
        of them or none (a beam still re-prefilling after a preemption holds the group back)."""
        beams = group.beam.live
        if any(b.status is not SeqStatus.RUNNING or b.num_pending != 1 for b in beams):
            return
        if state.budget < len(beams):
            return
        ids = [b.seq_id for b in beams]
        while not self.kv.can_append(ids, 1):
            victims = self._pick_victims(beams[0], state)
            self._preempt(victims, state)
            if any(b in victims for b in beams):
                return
        for beam in beams:
            self._emit(beam, 1, state)

    def _fits(self, seq: Sequence, num_tokens: int) -> bool:
        """Can `seq` append num_tokens now? For one sequence the general check (can_append, built
        for groups of sequences and several times the cost, paid for every running sequence
        every step) is exactly its own block count (new blocks + a copy) against the free
        blocks."""
        return self.kv.blocks_to_append(seq.seq_id, num_tokens) <= self.kv.num_free_blocks

    def _admit_waiting(self, state: _StepState) -> None:
        while self.waiting and state.budget > 0:
            seq = self.waiting[0]
            if self.running and len(self.running) + self._seats(seq) > self.max_num_seqs:
                break
            # Prompt logprobs need every position computed: no prefix hits then (as vLLM).
            cached = (0 if seq.group.wants_prompt_logprobs
                      else self.kv.num_cached_prefix_tokens(seq.token_ids))
            num_tokens = max(0, min(len(seq.token_ids) - cached - _held_back(seq), state.budget))
            if not self.kv.can_admit(seq.token_ids, num_tokens):
                break
            self.waiting.popleft()
            self._admit(seq)
            if num_tokens:
                self._emit(seq, num_tokens, state)

    def _seats(self, seq: Sequence) -> int:
        group = seq.group
        if group.beam is not None and any(b.status is SeqStatus.RUNNING for b in group.beam.live):
            return 1  # the rest of a beam group coming back from a preemption
        return group.seats

    def _unstick(self, state: _StepState) -> None:
        """Nothing ran: only beam groups waiting for members that do not fit are left. Give the
        newest one back to the queue (behind the members of the older ones) and retry."""
        group = self.running[-1].group
        if group.beam is None:
            return  # not a beam group: the engine reports the stall
        if all(s.group is group for s in self.running):
            raise RuntimeError(
                f"request {group.request_id!r}: its {len(group.seqs)} beams do not fit in the KV "
                f"pool ({self.kv.num_blocks} blocks) together; raise --kv-memory / --num-blocks "
                "or lower beam_width")
        victims = [s for s in self.running if s.group is group]
        self._preempt(victims, state, to_front=False)
        self._admit_waiting(state)
    def _admit(self, seq: Sequence) -> None:
        seq.num_computed = self.kv.admit(seq.seq_id, seq.token_ids,
                                         use_prefix_cache=not seq.group.wants_prompt_logprobs)
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
        group_tables = (self.kv.group_block_tables(seq.seq_id) if self.kv.num_groups > 1
                        else None)
        chunk = ScheduledChunk(
            token_ids=token_ids, start_pos=start,
            block_table=group_tables[0] if group_tables else self.kv.block_table(seq.seq_id),
            sample=end == len(seq.token_ids),
            prompt_logprobs=_scores_next_prompt_position(seq, start, end),
            group_tables=group_tables)
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
        victim = next(s for s in reversed(self.running) if s.seq_id not in state.scheduled)
        if victim.group.beam is None:
            return [victim]
        # Beams step together: their unscheduled members go back together.
        return [s for s in self.running if s.group is victim.group and
                s.seq_id not in state.scheduled]

    def _preempt(self, victims: list[Sequence], state: _StepState, to_front: bool = True) -> None:
        for victim in victims:
            self.kv.free(victim.seq_id)
            victim.num_computed = 0
            victim.status = SeqStatus.WAITING
        self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        if to_front:
            self.waiting.extendleft(reversed(victims))  # front of the queue, in their order
        else:
            self._queue_behind_partial_groups(victims)
        self.stats.preemptions += len(victims)
        state.output.preempted += len(victims)

    def _queue_behind_partial_groups(self, victims: list[Sequence]) -> None:
        """Victims go behind the waiting members of groups that still run (so those complete)."""
        running_groups = {id(s.group) for s in self.running}
        at = 0
        while at < len(self.waiting) and id(self.waiting[at].group) in running_groups:
            at += 1
        for offset, victim in enumerate(victims):
            self.waiting.insert(at + offset, victim)


def _held_back(seq: Sequence) -> int:
    """1 when the sequence's last token must wait: beams of a group (re-prefilling after a
    preemption) sample together, and a prefill-only sequence (a tree root) never samples."""
    group = seq.group
    if group.prefill_only or (group.beam is not None and len(group.beam.live) > 1):
        return 1
    return 0


def _scores_next_prompt_position(seq: Sequence, start: int, end: int) -> bool:
    """The chunk's rows (predicting positions start+1 .. end) include the next prompt position
    whose logprobs are still missing."""
    group = seq.group
    return group.wants_prompt_logprobs and start < len(group.prompt_logprobs) <= end


def rejection_reason(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                     block_size: int, num_blocks: int, vocab_size: int | None,
                     blocks_for_tokens: Callable[[int], int] | None = None) -> str | None:
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
    if vocab_size is not None and (params.logprobs or 0) > vocab_size:
        return (f"logprobs={params.logprobs} asks for more alternatives than the model's "
                f"{vocab_size} tokens")
    max_tokens = min(params.max_tokens, max_model_len - n)
    # The last generated token is returned but never stored, hence the - 1.
    stored = n + max_tokens - 1
    # A hybrid pool: the blocks every group holds at most (a sliding one only its window's).
    needed = blocks_for_tokens(stored) if blocks_for_tokens else -(-stored // block_size)
    if needed > num_blocks:
        return (f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {needed} KV blocks of "
                f"{block_size} tokens but the pool has only {num_blocks}; raise --kv-memory or "
                "--num-blocks, or lower max_tokens / --max-model-len")
    return None
