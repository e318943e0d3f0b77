"""Applies beam search steps to the engine's sequences: fork the beams chosen several times,
drop those chosen by none (their blocks are freed at once), append the chosen tokens.

The decision itself (which continuations survive) is beam_search.py's; this file only turns it
into block-table operations through the engine's general fork.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedgen.engine.beam_search import BeamStep, Candidate, advance, top_candidates
from pagedgen.engine.sequence import Sequence, SequenceGroup


def beam_rows_in_order(rows: list[Sequence]) -> tuple[list[SequenceGroup], list[int]]:
    """The beam groups of this step and, for each of their live beams in order, its row."""
    position = {seq.seq_id: i for i, seq in enumerate(rows)}
    groups = list({id(s.group): s.group for s in rows}.values())
    order = [position[b.seq_id] for g in groups for b in g.beam.live]
    if len(order) != len(rows):
        raise RuntimeError("a beam group was scheduled without all of its live beams")
    return groups, order


def run_beam_step(engine: Any, rows: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
    """One step for every beam group in `rows`; returns the sequences of groups now done."""
    groups, order = beam_rows_in_order(rows)
    logits = logits.index_select(0, torch.tensor(order, device=logits.device))
    states = [g.beam for g in groups]
    temperature = [g.beam.params.temperature for g in groups for _ in g.beam.live]
    ranked = top_candidates(logits, states, temperature)
    done: list[Sequence] = []
    for group, candidates in zip(groups, ranked):
        step = advance(group.beam, candidates)
        done += _apply(engine, group, step)
    engine.stats.generated_tokens += len(rows)
    return done


def _apply(engine: Any, group: SequenceGroup, step: BeamStep) -> list[Sequence]:
    state = group.beam
    old = state.live
    if not step.next_beams:
        return old
    owners = _owners(engine, group, step.next_beams)   # forks before any token is appended
    for beam, cand in zip(owners, step.next_beams):
        beam.token_ids.append(cand.token)
        beam.cumulative_logprob = cand.cumulative_logprob
    kept = {id(b) for b in owners}
    engine.scheduler.finish([b for b in old if id(b) not in kept])
    state.live = owners
    group.seqs = list(owners)
    return []


def _owners(engine: Any, group: SequenceGroup, chosen: list[Candidate]) -> list[Sequence]:
    """The sequence that carries each chosen continuation: the parent itself the first time it
    is chosen, a fresh fork of it (sharing its blocks) every further time."""
    taken: set[int] = set()
    owners = []
    for cand in chosen:
        parent = cand.parent
        if id(parent) in taken:
            index = group.beam.next_index
            group.beam.next_index += 1
            owners.append(engine.fork_sequence(parent, [index])[0])
        else:
            taken.add(id(parent))
            owners.append(parent)
    return owners
