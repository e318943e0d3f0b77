"""The engine step loop: scheduler -> runner -> sampler -> append / fork / stop -> finish -> tracker.

Per step the Python work is per sequence (a few attribute updates each), never per token: the
batch itself is built by the runner from the scheduled chunks, and the sampler works on tensors.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedgen.engine.engine_config import EngineConfig
from pagedgen.engine.detokenizer import final_text
from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.engine.scheduler import Scheduler, SchedulerOutput, rejection_reason
from pagedgen.engine.sequence import Sequence, SequenceGroup, SeqStatus, make_generator
from pagedgen.engine.stop_checker import StopDecision, check_stop
from pagedgen.engine.seq_info import SeqMemInfo
from pagedgen.engine.outputs import CompletionOutput, Logprob, RequestOutput, Usage
from pagedgen.engine.sampler import Sampler, SamplerOutput, build_batch
from pagedgen.engine.sampling_params import SamplingParams


class Runner(Protocol):
    num_blocks: int
    block_size: int
    device: torch.device

    def execute(self, batch: list, copies: list[tuple[int, int]]) -> torch.Tensor: ...


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0
    requests_finished: int = 0
    requests_failed: int = 0


class LLMEngine:
    def __init__(self, runner: Runner, tokenizer: Any, eos_token_ids: list[int], config: EngineConfig,
                 tracker: Any = None, hash_extra_key: object = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.config = config
        self.tracker = tracker
        self.device = torch.device(runner.device)
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size,
                                 config.enable_prefix_caching, hash_extra_key)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.stats = EngineStats()
        self._phase_hook: Any = None
        self._next_seq_id = 0
        self._rejected: list[RequestOutput] = []

    # --- requests in ---
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        """Queues a request. One that can never be served is answered (with `error`) by the next
        step() instead of raising, so that the other requests of a batch still complete."""
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to match text")
        group = self._new_group(request_id, prompt, prompt_token_ids, params)
        reason = rejection_reason(prompt_token_ids, params, self.config.max_model_len,
                                  self.runner.block_size, self.runner.num_blocks,
                                  self._vocab_size())
        if reason is not None:
            self._rejected.append(_failed_output(group, reason))
            return
        group.seqs.append(self._new_sequence(group))
        self.scheduler.add(group.seqs[0])

    def _vocab_size(self) -> int | None:
        return getattr(getattr(self.runner, "config", None), "vocab_size", None)

    def _new_group(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                   params: SamplingParams) -> SequenceGroup:
        room = max(0, self.config.max_model_len - len(prompt_token_ids))
        return SequenceGroup(request_id, prompt, list(prompt_token_ids), params,
                             min(params.max_tokens, room), self.eos_token_ids, time.monotonic())

    def _new_sequence(self, group: SequenceGroup) -> Sequence:
        seq_id = self._take_seq_id()
        prompt_len = len(group.prompt_token_ids)
        seq = Sequence(seq_id, group, 0, list(group.prompt_token_ids), prompt_len,
                       make_generator(group.params.seed, 0, self.device),
                       SeqMemInfo(seq_id, group.request_id, 0, 0, prompt_len, group.max_tokens))
        seq.start_outputs(self.tokenizer)
        return seq

    def _take_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._rejected)

    def abort_all(self) -> list[str]:
        """Drops every unfinished request and frees its blocks (after an error mid-run, so that
        the engine stays usable). Returns the aborted request ids."""
        scheduler = self.scheduler
        seqs = list(scheduler.running) + list(scheduler.waiting)
        scheduler.finish(list(scheduler.running))
        scheduler.waiting.clear()
        aborted = {s.group.request_id: None for s in seqs}
        aborted.update({o.request_id: None for o in self._rejected})
        self._rejected = []
        self.kv.take_pending_copies()
        return list(aborted)

    # --- one step ---
    def set_phase_hook(self, hook: Any) -> None:
        """Timing for `pagedgen profile`: each step runs inside hook.phase("step"), and its parts
        inside hook.phase(name) for "scheduling", "forward" (the runner, which times "attention"
        within it), "sampling"; the rest of the step is bookkeeping. None turns it off."""
        self._phase_hook = hook
        if hasattr(self.runner, "set_phase_hook"):
            self.runner.set_phase_hook(hook)

    def _phase(self, name: str) -> AbstractContextManager:
        return nullcontext() if self._phase_hook is None else self._phase_hook.phase(name)

    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns the requests that finished (or failed) in it."""
        with self._phase("step"):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        finished, self._rejected = self._rejected, []
        self.stats.requests_failed += len(finished)
        with self._phase("scheduling"):
            scheduled = self.scheduler.schedule()
        if not scheduled.chunks and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not schedule anything although requests are "
                               "waiting; the KV pool is too small for the next request")
        done = self._run(scheduled) if scheduled.chunks else []
        self.scheduler.finish(done)
        self.stats.steps += 1
        self._record()  # after finishing, so that the timeline of a finished run ends at 0 blocks
        return finished + self._finished_requests(done)

    def _run(self, scheduled: SchedulerOutput) -> list[Sequence]:
        """Forward, fork, sample, append; returns the sequences that finished."""
        with self._phase("forward"):
            logits = self.runner.execute(scheduled.chunks, scheduled.copies)
        sampled = [s for s, c in zip(scheduled.seqs, scheduled.chunks) if c.sample]
        if not sampled:
            return []
        rows, row_index = self._fork_where_due(sampled)
        if row_index is not None:
            logits = logits.index_select(0, torch.tensor(row_index, device=logits.device))
        batch = build_batch(rows, logits.shape[-1], logits.device)
        with self._phase("sampling"):
            sampled_tokens = self.sampler(logits, batch)
        return self._append_tokens(rows, sampled_tokens, batch.logprob_rows)

    def _fork_where_due(self, sampled: list[Sequence]) -> tuple[list[Sequence], list[int] | None]:
        """n > 1 groups whose prompt just finished fork now; every sample then draws its first
        token from the prompt's logits row, with its own generator."""
        if not any(s.group.needs_fork for s in sampled):
            return sampled, None
        rows, row_index = [], []
        for i, seq in enumerate(sampled):
            family = self._fork(seq) if seq.group.needs_fork else [seq]
            rows += family
            row_index += [i] * len(family)
        return rows, row_index

    def _fork(self, parent: Sequence) -> list[Sequence]:
        group = parent.group
        children = [parent.fork(self._take_seq_id(), k) for k in range(1, group.params.n)]
        self.scheduler.fork(parent, children)
        group.seqs += children
        group.forked = True
        return [parent, *children]

    def _append_tokens(self, rows: list[Sequence], result: SamplerOutput,
                       logprob_rows: list[int]) -> list[Sequence]:
        done = []
        logprob_position = {row: j for j, row in enumerate(logprob_rows)}  # result's row order
        now = time.monotonic()
        for i, seq in enumerate(rows):
            token = result.token_ids[i]
            seq.token_ids.append(token)
            if seq.logprobs is not None:
                _record_logprobs(seq, token, result, logprob_position[i])
            if seq.group.first_token_time is None:
                seq.group.first_token_time = now
            decision = self._stop_decision(seq, token)
            if decision is not None:
                _mark_finished(seq, decision)
                done.append(seq)
        self.stats.generated_tokens += len(rows)
        return done

    def _stop_decision(self, seq: Sequence, token: int) -> StopDecision | None:
        group = seq.group
        new_text_len = 0
        if seq.detokenizer is not None:
            new_text_len = len(seq.detokenizer.update(seq.token_ids))
            seq.text = seq.detokenizer.text
        return check_stop(token, seq.num_outputs, group.max_tokens, group.params,
                          group.eos_token_ids, seq.text, new_text_len)

    def _finished_requests(self, done: list[Sequence]) -> list[RequestOutput]:
        groups = {id(s.group): s.group for s in done}.values()
        outputs = [self._request_output(g) for g in groups if g.is_finished()]
        self.stats.requests_finished += len(outputs)
        return outputs

    def _request_output(self, group: SequenceGroup) -> RequestOutput:
        seqs = sorted(group.seqs, key=lambda s: s.sample_index)
        completions = [self._completion(s) for s in seqs]
        usage = Usage(len(group.prompt_token_ids), sum(s.num_outputs for s in seqs),
                      group.cached_prompt_tokens or 0)
        metrics = {"arrival_time": group.arrival_time, "finished_time": time.monotonic(),
                   "first_token_time": group.first_token_time or 0.0}
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             True, usage, None, metrics)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = final_text(self.tokenizer, seq)
        if seq.logprobs and self.tokenizer is not None:
            _decode_logprob_tokens(self.tokenizer, seq.logprobs)
        return CompletionOutput(seq.sample_index, text, seq.output_token_ids, seq.cumulative_logprob,
                                seq.logprobs, seq.finish_reason, seq.stop_reason)

    # --- memory tracking ---
    def attach_tracker(self, tracker: Any) -> None:
        """From now on every step is reported to `tracker.record(...)` (memory/tracker.py's
        shape); None stops the reporting."""
        self.tracker = tracker

    def reset_tracker(self) -> None:
        """Start the attached tracker's history afresh (a profile's warm-up must not show)."""
        if self.tracker is not None:
            self.tracker.reset()

    def _record(self) -> None:
        if self.tracker is None:
            return
        running = self.scheduler.running
        for seq in running:
            seq.mem_info.num_tokens = seq.num_computed
        stats = self.scheduler.stats
        self.tracker.record(self.stats.steps, self.kv.snapshot(), [s.mem_info for s in running],
                            len(self.scheduler.waiting), stats.preemptions, stats.recomputed_tokens,
                            block_tables=self.kv.block_tables,
                            cached_free_blocks=self.kv.cached_free_blocks)


def _record_logprobs(seq: Sequence, token: int, result: SamplerOutput, j: int) -> None:
    """The requested top-k at this position plus the sampled token (vLLM's shape)."""
    k = seq.params.logprobs
    entry = {t: Logprob(lp, rank + 1)
             for rank, (t, lp) in enumerate(zip(result.top_ids[j][:k], result.top_logprobs[j][:k]))}
    if token not in entry:
        entry[token] = Logprob(result.logprobs[j], result.ranks[j])
    seq.logprobs.append(entry)
    seq.cumulative_logprob += result.logprobs[j]


def _mark_finished(seq: Sequence, decision: StopDecision) -> None:
    seq.finish_reason = decision.finish_reason
    seq.stop_reason = decision.stop_reason
    if decision.truncate_text_at is not None:
        seq.text = seq.text[:decision.truncate_text_at]
    seq.status = SeqStatus.FINISHED


def _decode_logprob_tokens(tokenizer: Any, positions: list[dict[int, Logprob]]) -> None:
    ids = sorted({t for pos in positions for t in pos})
    texts = dict(zip(ids, tokenizer.batch_decode([[t] for t in ids])))
    for pos in positions:
        for t, lp in pos.items():
            lp.decoded_token = texts[t]


def _failed_output(group: SequenceGroup, reason: str) -> RequestOutput:
    usage = Usage(len(group.prompt_token_ids), 0, 0)
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, [], True, usage,
                         f"request {group.request_id!r}: {reason}")
