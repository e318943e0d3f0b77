"""Random admit / append / fork / free / prefix hits on a manager with layer groups, some with
sliding windows, against what a kernel would read.

The oracle is the pool's content, not the manager's bookkeeping: every append "writes" into each
slot the manager hands out the token's whole prefix (what a K/V vector depends on), copy-on-write
pairs are applied as the runner applies them, and after every step each sequence must find, in
every group, its own prefix at every position its window still reads. A block released too early,
reused while still read, a wrong prefix hit or a missed copy all show up as a wrong read.
"""

import copy

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedgen.engine.kv_manager import NULL_BLOCK, KVCacheManager
from pagedgen.engine.kv_types import NoFreeBlocksError

BASE = [(7 * i) % 3 for i in range(96)]


class GroupedKVMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 40), block_size=st.sampled_from([1, 2, 4]),
                windows=st.lists(st.sampled_from([0, 0, 1, 3, 5, 8]), min_size=1, max_size=3),
                caching=st.booleans())
    def build(self, num_blocks, block_size, windows, caching):
        self.kv = KVCacheManager(num_blocks, block_size, caching, "salt", windows)
        self.windows, self.b = windows, block_size
        self.pages: dict[tuple[int, int], tuple] = {}  # (group, slot) -> prefix written there
        self.scripts: dict[int, list[int]] = {}
        self.next_id = 0

    def live(self):
        return sorted(self.scripts)

    def write(self, seq: int, start: int, end: int) -> None:
        for copy_src, copy_dst in self.kv.take_pending_copies():
            for g in range(len(self.windows)):
                for offset in range(self.b):
                    src = (g, copy_src * self.b + offset)
                    if src in self.pages:
                        self.pages[(g, copy_dst * self.b + offset)] = self.pages[src]
        script = self.scripts[seq]
        for g in range(len(self.windows)):
            for t in range(start, end):
                self.pages[(g, self.kv.slot(seq, t, g))] = tuple(script[:t + 1])

    def append(self, seq: int, count: int) -> bool:
        start = self.kv.num_tokens(seq)
        tokens = self.scripts[seq][start:start + count]
        net = self.kv.blocks_to_append(seq, len(tokens))
        trial = copy.deepcopy(self.kv)
        try:
            trial.append_slots(seq, tokens)
            fits = True
        except NoFreeBlocksError:
            fits = False
        if net <= self.kv.num_free_blocks:  # the scheduler's check must never overpromise
            assert fits, "blocks_to_append said it fits but append_slots failed"
        if not fits:
            return False
        self.kv.append_slots(seq, tokens)
        self.write(seq, start, start + len(tokens))
        return True

    @rule(length=st.integers(1, 40), chunk=st.integers(1, 20), edit=st.integers(0, 95))
    def admit(self, length, chunk, edit):
        script = list(BASE)
        if edit >= length:  # some prompts share the whole base, others diverge inside it
            script[edit] = 5
        prompt, seq = script[:length], self.next_id
        can = self.kv.can_admit(prompt, min(chunk, length))
        try:
            hit = self.kv.admit(seq, prompt)
        except NoFreeBlocksError:
            assert not can
            return
        self.next_id += 1
        self.scripts[seq] = script
        assert hit % self.b == 0 and hit < length
        grew = self.append(seq, min(chunk, length - hit))
        assert grew or not can, "can_admit promised the first chunk"

    @precondition(lambda self: self.scripts)
    @rule(data=st.data(), count=st.integers(1, 12))
    def extend(self, data, count):
        self.append(data.draw(st.sampled_from(self.live())), count)

    @precondition(lambda self: self.scripts)
    @rule(data=st.data(), edit=st.integers(0, 4))
    def fork(self, data, edit):
        parent, child = data.draw(st.sampled_from(self.live())), self.next_id
        self.next_id += 1
        self.kv.fork(parent, child)
        script = list(self.scripts[parent])
        script[self.kv.num_tokens(parent)] = edit
        self.scripts[child] = script

    @precondition(lambda self: self.scripts)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        self.kv.free(seq)
        del self.scripts[seq]

    @invariant()
    def every_window_reads_its_own_prefix(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_integrity()
        for seq, script in self.scripts.items():
            n = self.kv.num_tokens(seq)
            tables = self.kv.group_block_tables(seq)
            for g, window in enumerate(self.windows):
                first = 0 if not window else max(0, n - window + 1)
                for t in range(first, n):
                    assert self.pages.get((g, self.kv.slot(seq, t, g))) == tuple(script[:t + 1]), \
                        f"sequence {seq}, group {g}: token {t} reads another prefix"
                if window:  # a sliding group keeps only its window (and the last chunk)
                    held = sum(1 for b in tables[g] if b != NULL_BLOCK)
                    assert held <= -(-(window + 20) // self.b) + 1


GroupedKVMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30,
                                              deadline=None)
TestGroupedKVManager = GroupedKVMachine.TestCase
