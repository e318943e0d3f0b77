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

from pagedgen.settings import EngineConfig
from pagedgen.engine.detokenizer import final_text
from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.engine.scheduler import Scheduler, SchedulerOutput, rejection_reason
from pagedgen.engine.sequence import Sequence, SequenceGroup, SeqStatus, make_generator
from pagedgen.engine.stop_checker import StopDecision, check_stop
from pagedgen.engine.seq_info import SeqMemInfo
from pagedgen.engine.outputs import (BeamCompletionOutput, CompletionOutput, Logprob,
                                     RequestOutput, Usage)
from pagedgen.engine.beam_search import BeamSearchParams, BeamState, beam_rejection_reason
from pagedgen.engine.beam_step import run_beam_step
from pagedgen.engine.sampler import Sampler, SamplerOutput, build_batch
from pagedgen.engine.sampling_params import SamplingParams
from pagedgen.engine.prompt_logprobs import record_prompt_logprobs
from pagedgen.engine.structured_outputs import GrammarBackend, InvalidConstraintError, backend_for
from pagedgen.engine.store_steps import PrefixStoreSetup, StoreTraffic, attach_store


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
                 tracker: Any = None, hash_extra_key: object = None,
                 prefix_store: PrefixStoreSetup | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.config = config
        self.tracker = tracker
        self.device = torch.device(runner.device)
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size,
                                 config.enable_prefix_caching, hash_extra_key,
                                 getattr(runner, "group_windows", (0,)))
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.stats = EngineStats()
        self._phase_hook: Any = None
        self._next_seq_id = 0
        self._rejected: list[RequestOutput] = []
        self.kept: dict[int, Sequence] = {}   # finished sequences holding their blocks (tree nodes)
        self.kept_by_request: dict[str, list[Sequence]] = {}
        self._roots = 0                        # tree roots still being prefilled
        self.grammar: GrammarBackend | None = None   # made by the first structured request
        self.store: StoreTraffic | None = None        # the prefix store on disk, when given
        if prefix_store is not None:
            self.store = attach_store(self.kv, runner, prefix_store)

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
                                  self._vocab_size(), self._blocks_for_tokens)
        if reason is None and params.structured_outputs is not None:
            reason = self._compile_constraint(group)
        if reason is not None:
            self._rejected.append(_failed_output(group, reason))
            return
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]   # nothing predicts the first prompt token
        group.seqs.append(self._new_sequence(group))
        self.scheduler.add(group.seqs[0])

    def add_beam_request(self, request_id: str, prompt_token_ids: list[int],
                         params: BeamSearchParams, prompt: str | None = None) -> None:
        """Queues a beam search request (beam_search.py has the semantics)."""
        sampling = SamplingParams(max_tokens=params.max_tokens, temperature=0.0,
                                  ignore_eos=params.ignore_eos,
                                  include_stop_str_in_output=params.include_stop_str_in_output)
        self.add_request(request_id, prompt_token_ids, sampling, prompt)
        if self._rejected and self._rejected[-1].request_id == request_id:
            return
        seq = self.scheduler.waiting[-1]
        reason = beam_rejection_reason(len(prompt_token_ids), seq.group.max_tokens,
                                       params.beam_width, self.runner.block_size,
                                       self.runner.num_blocks // self.kv.num_groups)
        if reason is not None:
            self.scheduler.waiting.pop()
            self._rejected.append(_failed_output(seq.group, reason))
            return
        seq.cumulative_logprob = 0.0
        seq.group.beam = BeamState(params, self.eos_token_ids, seq.group.max_tokens, [seq])

    def add_prefill_request(self, request_id: str, prompt_token_ids: list[int]) -> Sequence:
        """Computes the K/V of a prompt but its last token and keeps the sequence (a tree root);
        it is in `kept_by_request[request_id]` once its request finished."""
        self.add_request(request_id, prompt_token_ids, SamplingParams(max_tokens=1))
        if self._rejected and self._rejected[-1].request_id == request_id:
            raise ValueError(self._rejected.pop().error)
        seq = self.scheduler.waiting[-1]
        seq.group.prefill_only = seq.group.keep_kv = True
        self._roots += 1
        return seq

    def _roots_ready(self) -> list[Sequence]:
        """Tree roots whose prompt (but the last token) is computed by the end of this step."""
        ready = [s for s in self.scheduler.running if s.group.prefill_only and s.num_pending == 1]
        self._roots -= len(ready)
        return ready

    def add_branch_request(self, request_id: str, node: Sequence, params: SamplingParams) -> None:
        """Extends a kept sequence by params.n branches of up to params.max_tokens tokens each.
        The first branch shares the node's blocks (no prefix recompute); the others fork from
        it once its next-token logits are out. The branches are kept when they finish."""
        group = self._new_group(request_id, None, node.token_ids, params)
        group.keep_kv = True
        reason = rejection_reason(node.token_ids, params, self.config.max_model_len,
                                  self.runner.block_size, self.runner.num_blocks, None,
                                  self._blocks_for_tokens)
        if reason is not None:
            raise ValueError(f"request {request_id!r}: {reason}")
        seq = self._new_sequence(group)
        seq.num_computed = seq.high_water = node.num_computed
        self.kv.fork(node.seq_id, seq.seq_id)
        group.seqs.append(seq)
        group.cached_prompt_tokens = node.num_computed
        self.scheduler.start_running(seq)

    def release(self, seq_id: int) -> None:
        """Drops a kept sequence: its block references go at once."""
        self.kept.pop(seq_id)
        self.kv.free(seq_id)

    def fork_sequence(self, parent: Sequence, sample_indices: list[int]) -> list[Sequence]:
        """Branches a running sequence at its current position into len(sample_indices) new
        sequences sharing all its blocks by reference; a child writing into a shared, partially
        filled last block copies that one block first (copy-on-write)."""
        children = [parent.fork(self._take_seq_id(), index) for index in sample_indices]
        self.scheduler.fork(parent, children)
        parent.group.seqs += children
        return children

    def _compile_constraint(self, group: SequenceGroup) -> str | None:
        """Compiles the request's structured_outputs (cached); the reason when it is invalid."""
        if self.tokenizer is None:
            return "structured_outputs needs a tokenizer"
        try:
            if self.grammar is None:
                vocab = self._vocab_size() or len(self.tokenizer)
                self.grammar = backend_for(self.tokenizer, vocab, sorted(self.eos_token_ids))
            group.grammar = self.grammar.compile(group.params.structured_outputs)
        except InvalidConstraintError as exc:
            return str(exc)
        return None

    def _blocks_for_tokens(self, num_tokens: int) -> int:
        """Pages one sequence holds at most when alone (chunks up to the step's token budget)."""
        if self.kv.num_groups == 1 and not self.kv.group_windows[0]:
            return -(-num_tokens // self.runner.block_size)
        return self.kv.blocks_for_tokens(num_tokens, self.config.max_num_batched_tokens)

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
        if group.grammar is not None:
            seq.matcher = self.grammar.new_matcher(group.grammar)
        return seq

    def _take_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._rejected)

    def abort_all(self) -> list[str]:
        """Drops every unfinished request and frees its blocks, after an error or Ctrl-C
        mid-run, so that the engine stays usable. The cut may fall anywhere in a step, even
        inside a KV update: the KV manager recounts itself from the kept tree nodes instead of
        being unwound request by request. Returns the aborted request ids."""
        seqs = self.scheduler.drop_all()
        aborted = {s.group.request_id: None for s in seqs}
        aborted.update({o.request_id: None for o in self._rejected})
        self._rejected = []
        self._roots = 0
        self.kv.abort(keep=self.kept)
        if self.store is not None:
            self.store.drop_pending()
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
        if self.store is not None:
            self.store.before_step(self.runner)  # stored blocks admitted this step
        roots = self._roots_ready() if self._roots else []
        if not scheduled.chunks and not roots and self.scheduler.has_unfinished():
            held = f"; {len(self.kept)} kept tree nodes hold blocks: release some" \
                if self.kept else ""
            raise RuntimeError("the scheduler could not schedule anything although requests are "
                               f"waiting; the KV pool is too small for the next request{held}")
        started = time.perf_counter()
        done = roots + (self._run(scheduled) if scheduled.chunks else [])
        if self.store is not None:
            self.store.after_step(self.runner, time.perf_counter() - started, scheduled.num_tokens)
        self._finish(done)
        self.stats.steps += 1
        self._record()  # after finishing, so that the timeline of a finished run ends at 0 blocks
        return finished + self._finished_requests(done)

    def _finish(self, done: list[Sequence]) -> None:
        kept = [s for s in done if s.group.keep_kv]
        if not kept:
            self.scheduler.finish(done)
            return
        self.scheduler.finish([s for s in done if not s.group.keep_kv])
        self.scheduler.park(kept)
        for seq in kept:
            self.kept[seq.seq_id] = seq
            self.kept_by_request.setdefault(seq.group.request_id, []).append(seq)

    def _run(self, scheduled: SchedulerOutput) -> list[Sequence]:
        """Forward, fork, sample, append; returns the sequences that finished."""
        with self._phase("forward"):
            logits = self.runner.execute(scheduled.chunks, scheduled.copies)
            if any(c.prompt_logprobs for c in scheduled.chunks):
                record_prompt_logprobs(self.runner, scheduled.seqs, scheduled.chunks)
        sampled = [s for s, c in zip(scheduled.seqs, scheduled.chunks) if c.sample]
        if not sampled:
            return []
        done: list[Sequence] = []
        if any(s.group.beam is not None for s in sampled):
            beam_rows = [i for i, s in enumerate(sampled) if s.group.beam is not None]
            other = [i for i, s in enumerate(sampled) if s.group.beam is None]
            done += run_beam_step(self, [sampled[i] for i in beam_rows],
                                  logits.index_select(0, _index(beam_rows, logits)))
            if not other:
                return done
            sampled = [sampled[i] for i in other]
            logits = logits.index_select(0, _index(other, logits))
        return done + self._sample(sampled, logits)

    def _sample(self, sampled: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        rows, row_index = self._fork_where_due(sampled)
        if row_index is not None:
            logits = logits.index_select(0, torch.tensor(row_index, device=logits.device))
        if self.grammar is not None:
            self._mask_by_grammar(rows, logits)
        batch = build_batch(rows, logits.shape[-1], logits.device)
        with self._phase("sampling"):
            sampled_tokens = self.sampler(logits, batch)
        return self._append_tokens(rows, sampled_tokens, batch.logprob_rows)

    def _mask_by_grammar(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        """Forbidden tokens of constrained rows -> -inf (all rows at once); the others untouched."""
        constrained = [i for i, seq in enumerate(rows) if seq.matcher is not None]
        if constrained:
            self.grammar.mask_logits(logits, constrained, [rows[i].matcher for i in constrained])

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
        children = self.fork_sequence(parent, list(range(1, group.params.n)))
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
            if decision is None and seq.matcher is not None and not _grammar_continues(seq, token):
                decision = StopDecision("stop", None)
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
        if group.beam is not None:
            completions = self._beam_completions(group)
        else:
            seqs = sorted(group.seqs, key=lambda s: s.sample_index)
            completions = [self._completion(s) for s in seqs]
        usage = Usage(len(group.prompt_token_ids), sum(len(c.token_ids) for c in completions),
                      group.cached_prompt_tokens or 0)
        metrics = {"arrival_time": group.arrival_time, "finished_time": time.monotonic(),
                   "first_token_time": group.first_token_time or 0.0}
        if group.prompt_logprobs and self.tokenizer is not None:
            _decode_logprob_tokens(self.tokenizer, group.prompt_logprobs[1:])
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             True, usage, None, metrics, group.prompt_logprobs)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = final_text(self.tokenizer, seq)
        if seq.logprobs and self.tokenizer is not None:
            _decode_logprob_tokens(self.tokenizer, seq.logprobs)
        return CompletionOutput(seq.sample_index, text, seq.output_token_ids, seq.cumulative_logprob,
                                seq.logprobs, seq.finish_reason, seq.stop_reason)

    def _beam_completions(self, group: SequenceGroup) -> list[CompletionOutput]:
        keep_eos = group.params.include_stop_str_in_output
        outputs = []
        for rank, hyp in enumerate(group.beam.hypotheses):
            ids = hyp.token_ids if keep_eos or hyp.finish_reason != "stop" else hyp.token_ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""
            outputs.append(BeamCompletionOutput(rank, text, hyp.token_ids, hyp.cumulative_logprob,
                                                None, hyp.finish_reason, None, hyp.score))
        return outputs

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
        if self.kept:  # kept tree nodes hold blocks too: they show in the tables and replays
            running = running + list(self.kept.values())
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


def _grammar_continues(seq: Sequence, token: int) -> bool:
    """Feeds the token to the sample's matcher; False when the grammar is complete (nothing
    but EOS could follow: finish now, as EOS would) or, only when the mask left nothing to
    choose (min_tokens banning the EOS a finished grammar needs), rejected the token."""
    matcher = seq.matcher
    return matcher.consume_token(token) and not matcher.is_stopped()


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


def _index(rows: list[int], logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, device=logits.device)


def _failed_output(group: SequenceGroup, reason: str) -> RequestOutput:
    usage = Usage(len(group.prompt_token_ids), 0, 0)
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, [], True, usage,
                         f"request {group.request_id!r}: {reason}")
