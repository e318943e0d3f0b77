"""The scheduler's per-sequence room check (Scheduler._fits) answers exactly as the general
KVCacheManager.can_append it short-cuts, and an engine run with it produces the same tokens,
preemptions and copies as one that always takes the general check."""
from __future__ import annotations

import random

from pagedgen import LLM, SamplingParams
from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.engine.scheduler import Scheduler
from tiny_models import tiny_model_dir


class _Seq:   # what _fits reads of a sequence
    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id


def test_fits_equals_can_append_over_random_states():
    """Random admits, appends, forks (shared partial blocks: copy-on-write cases) and frees on
    a small pool; after every operation both answers agree for every sequence and size."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    live, next_id, checked = [], 0, 0
    for _ in range(400):
        op = rng.random()
        if op < 0.25 or not live:
            tokens = [rng.randrange(6) for _ in range(rng.randint(1, 9))]
            if kv.can_admit(tokens, len(tokens)):
                cached = kv.admit(next_id, tokens)
                kv.append_slots(next_id, tokens[cached:])
                live.append(next_id)
                next_id += 1
        elif op < 0.4:
            kv.fork(rng.choice(live), next_id)
            live.append(next_id)
            next_id += 1
        elif op < 0.55:
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            seq_id = rng.choice(live)
            count = rng.randint(1, 6)
            if kv.can_append([seq_id], count):
                kv.append_slots(seq_id, [rng.randrange(6) for _ in range(count)])
        for seq_id in live:
            for count in (0, 1, 3, 7, 40):
                assert scheduler._fits(_Seq(seq_id), count) == kv.can_append([seq_id], count)
                checked += 1
    assert checked > 1000


def run(folder, general_check: bool):
    llm = LLM(str(folder), dtype="float32", block_size=16, num_blocks=40, seed=0, max_num_seqs=32,
              max_num_batched_tokens=256)
    scheduler = llm.engine.scheduler
    if general_check:   # what the scheduler did before the short cut
        scheduler._fits = lambda seq, n: scheduler.kv.can_append([seq.seq_id], n)
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(rng.randint(5, 60))] for _ in range(6)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    summary = llm.memory_report()["summary"]
    return ([[c.token_ids for c in o.outputs] for o in outputs],
            (scheduler.stats.preemptions, scheduler.stats.recomputed_tokens, summary["cow_copies"]))


def test_engine_outputs_unchanged_by_the_short_cut():
    """n = 4 at temperature 1 from a shared prefix in a pool too small for all 24 samples:
    forks, copy-on-write and preemptions all happen, and nothing differs."""
    folder = tiny_model_dir("llama")
    fast, fast_stats = run(folder, general_check=False)
    general, general_stats = run(folder, general_check=True)
    assert fast == general
    assert fast_stats == general_stats
    preemptions, _, cow_copies = fast_stats
    assert preemptions > 0 and cow_copies > 0
