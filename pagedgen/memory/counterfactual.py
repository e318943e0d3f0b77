"""What other KV allocators would have reserved for the very same trace of running sequences.

Paging reserves at most one partially filled block per sequence. The alternatives, replayed
step by step on the sequences the engine actually ran (each parallel sample on its own, as a
contiguous allocator cannot share a prompt):

- static_max_model_len: every running sequence reserves max_model_len slots up front;
- static_request: every running sequence reserves prompt + max_tokens (capped at max_model_len);
- dynamic_doubling: a buffer starting at the prompt length that doubles when full;
- first_fit_arena: the static_request regions placed first-fit in an arena of the pool's size,
  counting requests that would have failed (see arena.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedgen.memory.arena import FirstFitArena
from pagedgen.engine.seq_info import SeqMemInfo

POLICIES = ("static_max_model_len", "static_request", "dynamic_doubling")


@dataclass(slots=True)
class StepReservation:
    """Slots each policy holds at one step, and the tokens actually live (no sharing)."""
    static_max_model_len: int
    static_request: int
    dynamic_doubling: int
    live_tokens: int


def doubling_capacity(num_tokens: int, prompt_tokens: int, max_model_len: int) -> int:
    """Capacity of a buffer that starts at the prompt length and doubles when full."""
    initial = max(prompt_tokens, 1)
    growth = -(-num_tokens // initial)                  # ceil(num_tokens / initial)
    capacity = initial << max(growth - 1, 0).bit_length()  # initial * next power of two
    return max(min(capacity, max_model_len), num_tokens)


def doubling_capacities(num_tokens: np.ndarray, prompt_tokens: np.ndarray, max_model_len: int) -> np.ndarray:
    """doubling_capacity over arrays (int64)."""
    initial = np.maximum(prompt_tokens, 1)
    growth = np.maximum(-(-num_tokens // initial), 1)
    capacity = initial << np.ceil(np.log2(growth)).astype(np.int64)
    return np.maximum(np.minimum(capacity, max_model_len), num_tokens)


def step_reservation(running: Sequence[SeqMemInfo], max_model_len: int) -> StepReservation:
    # One Python pass per field to read the objects; the arithmetic is vectorized, since the
    # engine calls this every step with up to max_num_seqs sequences.
    column = lambda name: np.fromiter((getattr(s, name) for s in running), np.int64, len(running))  # noqa: E731
    tokens, prompt, max_tokens = column("num_tokens"), column("prompt_tokens"), column("max_tokens")
    request = np.maximum(np.minimum(prompt + max_tokens, max_model_len), tokens)
    doubling = doubling_capacities(tokens, prompt, max_model_len)
    return StepReservation(len(running) * max_model_len, int(request.sum()), int(doubling.sum()),
                           int(tokens.sum()))


@dataclass(slots=True)
class PolicyPeak:
    reserved_tokens: int = 0
    live_tokens: int = 0       # tokens in use at that peak step
    step: int = -1
    total_reserved: int = 0    # summed over steps, for the mean footprint per sequence


@dataclass(slots=True)
class CounterfactualReplay:
    """Fed once per engine step; O(running) per step, O(running) memory."""
    max_model_len: int
    arena_slots: int
    peaks: dict[str, PolicyPeak] = field(default_factory=lambda: {p: PolicyPeak() for p in POLICIES})
    sequence_steps: int = 0    # sum over steps of the number of running sequences
    arena: FirstFitArena = field(init=False)
    _in_arena: set[int] = field(default_factory=set)   # seq ids placed or refused

    def __post_init__(self) -> None:
        self.arena = FirstFitArena(self.arena_slots)

    def update(self, step: int, running: Sequence[SeqMemInfo]) -> StepReservation:
        reservation = step_reservation(running, self.max_model_len)
        self.sequence_steps += len(running)
        for policy in POLICIES:
            self._update_peak(self.peaks[policy], getattr(reservation, policy), reservation, step)
        self._replay_arena(running)
        return reservation

    @staticmethod
    def _update_peak(peak: PolicyPeak, reserved: int, reservation: StepReservation, step: int) -> None:
        peak.total_reserved += reserved
        if reserved > peak.reserved_tokens:
            peak.reserved_tokens, peak.live_tokens, peak.step = reserved, reservation.live_tokens, step

    def _replay_arena(self, running: Sequence[SeqMemInfo]) -> None:
        # Departures first (finished or preempted), so their space serves this step's arrivals.
        # A sequence that comes back after preemption is a new request for the arena.
        current = {seq.seq_id: seq for seq in running}
        for seq_id in self._in_arena - current.keys():
            if self.arena.owns(seq_id):
                self.arena.release(seq_id)
        arrivals = [seq for seq_id, seq in current.items() if seq_id not in self._in_arena]
        self._in_arena = set(current)
        for seq in arrivals:
            length = min(seq.prompt_tokens + seq.max_tokens, self.max_model_len)
            self.arena.allocate(seq.seq_id, max(length, seq.num_tokens, 1))
