"""A model-free schedule over a real KVCacheManager, feeding a MemoryTracker.

It exercises exactly the paging the engine does — demand paging, prefix hits, zero-copy fork
for n > 1 and copy-on-write, preemption by recompute — without computing a single logit, so
memory behaviour (and the memory report) can be studied and tested in milliseconds. The
policy is deliberately plain: FIFO admission with whole-prompt prefill, one decode token per
running sequence per step, newest-first preemption.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedgen.engine.seq_info import SeqMemInfo
from pagedgen.memory.tracker import MemoryTracker


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    n: int = 1


@dataclass(slots=True)
class SimSequence:
    seq_id: int
    request: SimRequest
    sample_index: int
    tokens: list[int]          # prompt + generated (the last one is not in the cache yet)
    generated: int = 0
    forked: bool = False       # children already made (n > 1), or this is a child


@dataclass(slots=True)
class SimState:
    waiting: deque[SimSequence] = field(default_factory=deque)
    running: list[SimSequence] = field(default_factory=list)
    next_seq_id: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    finished: int = 0


@dataclass(slots=True)
class Simulation:
    """Drive `manager` until every request finished; record every step into `tracker`."""
    manager: object            # KVCacheManager (contract section 3)
    tracker: MemoryTracker
    max_num_seqs: int = 256
    seed: int = 0
    max_steps: int = 1_000_000
    state: SimState = field(default_factory=SimState)

    def run(self, requests: Sequence[SimRequest]) -> SimState:
        self.submit(requests)
        rng = random.Random(self.seed)
        for step in range(self.max_steps):
            if self.done:
                return self.state
            self.step(step, rng)
        raise RuntimeError(f"simulation did not finish within max_steps={self.max_steps}")

    def submit(self, requests: Sequence[SimRequest]) -> None:
        for request in requests:
            if request.n < 1 or request.max_tokens < 1 or not request.prompt:
                raise ValueError(f"request {request.request_id!r}: needs a prompt, n >= 1 and "
                                 "max_tokens >= 1")
            self.state.waiting.append(self._new_sequence(request, 0, list(request.prompt),
                                                         forked=request.n == 1))

    @property
    def done(self) -> bool:
        return not (self.state.waiting or self.state.running)

    def step(self, step: int, rng: random.Random) -> None:
        self._decode(rng)
        self._admit(rng)
        self._finish()
        self._record(step)

    def _new_sequence(self, request: SimRequest, index: int, tokens: list[int], forked: bool) -> SimSequence:
        seq = SimSequence(self.state.next_seq_id, request, index, tokens, forked=forked)
        self.state.next_seq_id += 1
        return seq

    def _decode(self, rng: random.Random) -> None:
        # The token sampled last step is computed now (needs its slot); the next one is sampled.
        while self.state.running and not self.manager.can_append([s.seq_id for s in self.state.running], 1):
            self._preempt(self.state.running.pop())
        for seq in self.state.running:
            self.manager.append_slots(seq.seq_id, seq.tokens[-1:])
            self._sample(seq, rng)
        self.manager.take_pending_copies()   # a model runner would copy these blocks now

    def _preempt(self, seq: SimSequence) -> None:
        self.manager.free(seq.seq_id)
        self.state.preemptions += 1
        self.state.waiting.appendleft(seq)

    def _admit(self, rng: random.Random) -> None:
        waiting = self.state.waiting
        while waiting:
            seq = waiting[0]
            joining = 1 if seq.forked else seq.request.n   # its samples run side by side
            if len(self.state.running) + joining > self.max_num_seqs:
                return
            if not self.manager.can_admit(seq.tokens, len(seq.tokens)):
                if not self.state.running:
                    raise RuntimeError(f"request {seq.request.request_id} cannot fit in an empty pool")
                return
            waiting.popleft()
            self._prefill(seq, rng)

    def _prefill(self, seq: SimSequence, rng: random.Random) -> None:
        hits = self.manager.admit(seq.seq_id, seq.tokens)
        self.manager.append_slots(seq.seq_id, seq.tokens[hits:])
        if seq.generated:   # back after preemption: these tokens are computed a second time
            self.state.recomputed_tokens += len(seq.tokens) - hits
        self._sample(seq, rng)
        self.state.running.append(seq)
        if not seq.forked:
            self._fork(seq, rng)

    def _fork(self, parent: SimSequence, rng: random.Random) -> None:
        # n > 1: the samples share the prompt's blocks; each then samples its own first token.
        parent.forked = True
        for index in range(1, parent.request.n):
            child = self._new_sequence(parent.request, index, parent.tokens[:-1], forked=True)
            self.manager.fork(parent.seq_id, child.seq_id)
            self._sample(child, rng)
            self.state.running.append(child)

    @staticmethod
    def _sample(seq: SimSequence, rng: random.Random) -> None:
        seq.tokens.append(rng.randrange(1000, 30000))
        seq.generated += 1

    def _finish(self) -> None:
        done = [s for s in self.state.running if s.generated >= s.request.max_tokens]
        for seq in done:
            self.manager.free(seq.seq_id)
        self.state.running = [s for s in self.state.running if s.generated < s.request.max_tokens]
        self.state.finished += len(done)

    def _record(self, step: int) -> None:
        running = [SeqMemInfo(s.seq_id, s.request.request_id, s.sample_index,
                              self.manager.num_tokens(s.seq_id), len(s.request.prompt),
                              s.request.max_tokens) for s in self.state.running]
        self.tracker.record(step, self.manager.snapshot(), running, len(self.state.waiting),
                            self.state.preemptions, self.state.recomputed_tokens,
                            self.manager.block_tables, self.manager.ref_count,
                            cached_free_blocks=self.manager.cached_free_blocks)
