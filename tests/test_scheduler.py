"""The scheduler against the real KV manager, with no model: budgets, chunking, preemption."""

from __future__ import annotations

import itertools

import pytest

from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.engine.scheduler import Scheduler, rejection_reason
from pagedgen.engine.sequence import Sequence, SequenceGroup, SeqStatus
from pagedgen.engine.seq_info import SeqMemInfo
from pagedgen.engine.sampling_params import SamplingParams

B = 4
_ids = itertools.count()


def make_seq(prompt_len: int, max_tokens: int = 8, first_token: int = 0) -> Sequence:
    prompt = list(range(first_token, first_token + prompt_len))
    group = SequenceGroup(f"r{next(_ids)}", None, prompt, SamplingParams(max_tokens=max_tokens),
                          max_tokens, frozenset(), 0.0)
    seq_id = next(_ids)
    seq = Sequence(seq_id, group, 0, list(prompt), prompt_len, None,
                   SeqMemInfo(seq_id, group.request_id, 0, 0, prompt_len, max_tokens))
    group.seqs.append(seq)
    return seq


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=32, caching=False) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, B, caching), max_num_seqs, budget)


def run_step(scheduler: Scheduler, next_token: int = 7):
    """One step as the engine does it, with a made-up sampled token for each finished chunk."""
    out = scheduler.schedule()
    for seq, chunk in zip(out.seqs, out.chunks):
        if chunk.sample:
            seq.token_ids.append(next_token)
    scheduler.kv.check_integrity()
    return out


def test_budget_is_shared_decodes_first_then_chunked_prefill():
    scheduler = make_scheduler(budget=10)
    short = make_seq(3)
    scheduler.add(short)
    run_step(scheduler)                       # short prefilled, now decoding
    long = make_seq(25, first_token=100)
    scheduler.add(long)
    out = run_step(scheduler)
    assert out.seqs == [short, long]
    assert [len(c.token_ids) for c in out.chunks] == [1, 9]   # decode first, the rest of the budget
    assert [c.sample for c in out.chunks] == [True, False]    # a partial prefill samples nothing
    out = run_step(scheduler)
    assert [(c.start_pos, len(c.token_ids)) for c in out.chunks] == [(4, 1), (9, 9)]
    out = run_step(scheduler)
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in out.chunks] == [(5, 1, True), (18, 7, True)]
    assert scheduler.stats.prompt_tokens_computed == 3 + 25


def test_chunks_carry_block_tables_covering_their_tokens():
    scheduler = make_scheduler(max_num_seqs=2, budget=6)
    seq = make_seq(14)
    scheduler.add(seq)
    starts = []
    while seq.num_pending:
        chunk = run_step(scheduler).chunks[0]
        starts.append(chunk.start_pos)
        assert len(chunk.block_table) == -(-(chunk.start_pos + len(chunk.token_ids)) // B)
        if chunk.sample:
            break
    assert starts == [0, 6, 12]


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2)
    for _ in range(3):
        scheduler.add(make_seq(2))
    run_step(scheduler)
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1


def test_budget_must_cover_one_token_per_sequence():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_seqs=8, budget=4)


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=4, budget=32)
    old, new = make_seq(8), make_seq(8, first_token=50)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)   # 2 full blocks each: the pool is full
    out = run_step(scheduler)  # each decode needs a third block: the newest must go
    assert out.seqs == [old] and out.preempted == 1
    assert new.status is SeqStatus.WAITING and scheduler.waiting[0] is new
    assert new.num_computed == 0 and scheduler.stats.preemptions == 1
    scheduler.finish([old])
    out = run_step(scheduler)  # re-admitted: recomputes prompt + its sampled token
    assert out.seqs == [new] and out.chunks[0].token_ids == list(range(50, 58)) + [7]
    assert scheduler.stats.recomputed_tokens == 8


def test_a_lone_group_too_big_for_the_pool_sheds_samples_instead_of_looping():
    scheduler = make_scheduler(num_blocks=5, budget=32)
    parent = make_seq(6)
    parent.group.params = SamplingParams(n=3)
    scheduler.add(parent)
    run_step(scheduler)
    children = [parent.fork(next(_ids), i) for i in (1, 2)]
    scheduler.fork(parent, children)
    parent.group.forked = True
    for child in children:
        child.token_ids[-1] = 8  # each sample drew its own token
    for _ in range(6):
        out = run_step(scheduler)
        assert out.seqs and out.seqs[0] is parent   # the oldest sample always progresses
    assert scheduler.stats.preemptions > 0


def test_rejection_reasons_say_what_to_change():
    params = SamplingParams(max_tokens=10)
    assert rejection_reason([1] * 10, params, 64, 4, 16, 100) is None
    too_long = rejection_reason([1] * 5000, params, 4096, 16, 10_000, None)
    assert "prompt has 5000 tokens but max_model_len is 4096" in too_long
    assert "raise --max-model-len or shorten the prompt" in too_long
    too_big = rejection_reason([1] * 60, params, 1000, 4, 16, None)
    assert "needs 18 KV blocks" in too_big and "16" in too_big and "max_tokens" in too_big
    assert "empty" in rejection_reason([], params, 64, 4, 16, None)
    assert "[0, 100)" in rejection_reason([1, 100], params, 64, 4, 16, 100)
