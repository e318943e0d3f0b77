"""Beam groups in the scheduler, with no model: all-or-none steps and partly re-admitted groups."""

from __future__ import annotations

import itertools

import pytest

from pagedgen.engine.beam_search import BeamSearchParams, BeamState
from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.engine.scheduler import Scheduler
from pagedgen.engine.sequence import Sequence, SequenceGroup
from pagedgen.engine.seq_info import SeqMemInfo
from pagedgen.engine.sampling_params import SamplingParams

B = 4
_ids = itertools.count()


def beam_group(name: str, beams: list[list[int]]) -> list[Sequence]:
    """A beam group whose live beams wait in the queue (as after a preemption)."""
    group = SequenceGroup(name, None, beams[0][:2], SamplingParams(max_tokens=32), 32,
                          frozenset(), 0.0)
    seqs = []
    for index, tokens in enumerate(beams):
        seq_id = next(_ids)
        seqs.append(Sequence(seq_id, group, index, list(tokens), 2, None,
                             SeqMemInfo(seq_id, name, index, 0, 2, 32)))
    group.seqs = list(seqs)
    group.beam = BeamState(BeamSearchParams(len(beams), 32), frozenset(), 32, list(seqs))
    return seqs


def test_partly_readmitted_groups_do_not_block_each_other():
    scheduler = Scheduler(KVCacheManager(8, B, False), 8, 64)
    a1, a2 = beam_group("A", [list(range(10)), list(range(1, 11))])
    b1, b2 = beam_group("B", [list(range(20, 30)), list(range(21, 31))])
    for seq in (a1, b1, a2, b2):        # interleaved: each group gets one beam in at first
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.seqs == [a1, b1] and [len(c.token_ids) for c in out.chunks] == [9, 9]
    assert not any(c.sample for c in out.chunks)         # the last token waits for the group
    out = scheduler.schedule()       # stuck: B goes back behind A's missing beam, which comes in
    assert out.seqs == [a2] and list(scheduler.waiting) == [b1, b2]
    out = scheduler.schedule()
    assert out.seqs == [a1, a2] and all(c.sample for c in out.chunks)   # A steps as one
    scheduler.kv.check_integrity()


def test_a_group_that_cannot_fit_alone_is_an_error_naming_it():
    scheduler = Scheduler(KVCacheManager(5, B, False), 8, 64)
    for seq in beam_group("big", [list(range(10)), list(range(1, 11))]):
        scheduler.add(seq)
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="'big'.*do not fit"):
        scheduler.schedule()
