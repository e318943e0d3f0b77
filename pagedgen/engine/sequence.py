"""Requests (sequence groups) and their sequences: the engine's per-request state.

A request starts as one sequence holding the prompt. With n > 1 it forks into n sequences once
the prompt is prefilled; each sequence is one sample. The scheduler works on sequences; the
group is what preemption picks and what comes back to the caller.
"""

from __future__ import annotations

import copy
import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedgen.engine.detokenizer import IncrementalDetokenizer
from pagedgen.engine.seq_info import SeqMemInfo
from pagedgen.engine.outputs import Logprob
from pagedgen.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample i's own random stream, derived from (request seed, i)."""
    if sample_index == 0:
        return seed  # a seeded n = 1 request uses its seed as given
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def make_generator(seed: int | None, sample_index: int, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(sample_seed(seed, sample_index))
    return generator


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request: its prompt, parameters and samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                       # params.max_tokens clamped to max_model_len
    eos_token_ids: frozenset[int]
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False                  # n > 1 groups fork once, after their prefill
    cached_prompt_tokens: int | None = None  # from the first admission only
    first_token_time: float | None = None
    beam: Any = None                      # a BeamState for beam search requests
    keep_kv: bool = False                 # finished sequences keep their blocks (tree nodes)
    prefill_only: bool = False            # computes the prompt but the last token, then is kept
    grammar: Any = None                   # compiled structured_outputs constraint, if any
    # [None, {token: Logprob}, ...] as far as computed; None when not asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt positions are still to be scored (then prefix-cache hits are skipped)."""
        logprobs = self.prompt_logprobs
        return logprobs is not None and len(logprobs) < len(self.prompt_token_ids)

    @property
    def needs_fork(self) -> bool:
        return self.params.n > 1 and not self.forked

    @property
    def seats(self) -> int:
        """Running slots (max_num_seqs) the group will take once admitted and forked."""
        if self.beam is not None:
            return self.beam.width
        return self.params.n if self.needs_fork else 1

    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return (not self.needs_fork) and all(s.status is SeqStatus.FINISHED for s in self.seqs)


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample: its tokens (prompt + output) and how many of them are in the KV cache."""

    seq_id: int
    group: SequenceGroup
    sample_index: int
    token_ids: list[int]
    prompt_len: int
    generator: torch.Generator | None
    mem_info: SeqMemInfo
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0                 # tokens whose K/V are in the cache (or scheduled now)
    high_water: int = 0                   # most tokens ever computed: re-computation is counted
    cumulative_logprob: float | None = None   # kept when logprobs are asked for
    logprobs: list[dict[int, Logprob]] | None = None
    detokenizer: IncrementalDetokenizer | None = None
    text: str | None = None               # set while detokenizing (stop strings) and at finish
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    matcher: Any = None                   # this sample's position in its group's grammar

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    def banned_token_ids(self) -> list[int]:
        """Until min_tokens are out, EOS and the stop tokens cannot be sampled (vLLM's rule)."""
        params = self.group.params
        if self.num_outputs >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos else sorted(self.group.eos_token_ids)
        return eos + params.stop_token_ids

    def fork(self, seq_id: int, sample_index: int) -> Sequence:
        """A branch sharing everything so far (its K/V: kv_manager.fork), at any position:
        the child carries on from the parent's tokens, text and logprobs, with its own random
        stream (sample_index's)."""
        group = self.group
        child = Sequence(
            seq_id, group, sample_index, list(self.token_ids), self.prompt_len,
            make_generator(group.params.seed, sample_index, _device_of(self.generator)),
            SeqMemInfo(seq_id, group.request_id, sample_index, self.num_computed,
                       self.prompt_len, group.max_tokens),
            self.status, self.num_computed, self.high_water, self.cumulative_logprob,
            None if self.logprobs is None else list(self.logprobs),
            copy.copy(self.detokenizer), self.text)
        if self.matcher is not None:
            child.matcher = self.matcher.deep_copy()   # its own grammar state from here on
        return child

    def start_outputs(self, tokenizer: Any) -> None:
        """The per-sample output state its params ask for: a detokenizer when stop strings must
        be matched in the text, and logprob lists."""
        params = self.group.params
        if params.stop:
            self.detokenizer = IncrementalDetokenizer(tokenizer, self.token_ids,
                                                      params.skip_special_tokens)
            self.text = ""
        if params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0


def _device_of(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")
