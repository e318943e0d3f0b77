"""Beam search inside the engine: parameters, per-request state, and the per-step selection.

Semantics are transformers' `generate(num_beams=W, do_sample=False)` (generation/utils.py,
`_beam_search`), step for step, per request:

* every step ranks the top K = max(2, 1 + #EOS) * W continuations (cumulative log-probability of
  beam + token) among all live beams' next tokens;
* of those, candidates that end (EOS, or the length limit) are finished hypotheses, but only when
  they rank among the first W; their score is cumulative logprob / generated_len ** length_penalty,
  where generated_len counts the new token (EOS included). The best W hypotheses are kept;
* the first W candidates that do not end become the next live beams: a beam chosen by several
  candidates forks (its blocks are shared), a beam chosen by none is dropped (its blocks freed);
* a request is done when its best live beam cannot beat its worst of W finished hypotheses
  (best live score / generated_len ** length_penalty, or max_tokens ** length_penalty with
  early_stopping="never" and a positive penalty), when early_stopping=True and W hypotheses
  are in, or at max_tokens.

The selection is vectorized over every beam row of the step (all requests at once): one
log-softmax and one top-k per row, then one top-k per request over its beams' candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedgen.engine.sampling_params import check_field

NO_HYPOTHESIS = float("-inf")


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams, plus transformers' early_stopping (False, True or "never").

    temperature 0 (the default) ranks by the model's log-probabilities; a positive temperature
    divides the logits first."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        # The same rules as a JSONL line's fields (sampling_params.py owns them).
        for name in ("beam_width", "max_tokens", "ignore_eos", "temperature", "length_penalty",
                     "include_stop_str_in_output"):
            setattr(self, name, check_field(name, getattr(self, name), "BeamSearchParams.{}"))
        if self.early_stopping not in (False, True, "never"):
            raise ValueError("BeamSearchParams.early_stopping must be False, True or 'never', "
                             f"got {self.early_stopping!r}")


def beam_rejection_reason(prompt_len: int, max_tokens: int, width: int, block_size: int,
                          num_blocks: int) -> str | None:
    """Why W beams can never run together (None when they can): sharing only the prompt's
    full blocks, each beam needs its generated tokens' blocks plus its copied partial block
    (the last generated token is never stored)."""
    shared = prompt_len // block_size
    own = -(-(prompt_len % block_size + max_tokens - 1) // block_size)
    needed = shared + width * own
    if needed <= num_blocks:
        return None
    return (f"beam_width {width} with a {prompt_len}-token prompt and max_tokens {max_tokens} "
            f"needs up to {needed} KV blocks of {block_size} tokens but the pool has only "
            f"{num_blocks}; raise --kv-memory / --num-blocks, or lower beam_width or max_tokens")


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its output tokens and scores."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float                       # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str                 # "stop" (EOS) or "length"


@dataclass(slots=True, eq=False)
class BeamState:
    """One request's beam search: its live beams (Sequences, best first) and hypotheses."""

    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    max_tokens: int                    # params.max_tokens clamped to the model length
    live: list[Any] = field(default_factory=list)
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first, at most W
    generated: int = 0                 # tokens generated so far by every live beam
    improvable: bool = True            # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False
    next_index: int = 1                # sample_index of the next forked beam (block map labels)

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        eos = 0 if self.params.ignore_eos else len(self.eos_token_ids)
        return max(2, 1 + eos) * self.width

    def full(self) -> bool:
        return len(self.hypotheses) >= self.width


@dataclass(slots=True)
class Candidate:
    parent: Any                        # the live beam (Sequence) it extends
    token: int
    cumulative_logprob: float


@dataclass(slots=True)
class BeamStep:
    """What one step decided for one request."""

    next_beams: list[Candidate]        # best first; empty when the request is done


def top_candidates(logits: torch.Tensor, groups: list[BeamState], temperature: list[float]
                   ) -> list[list[Candidate]]:
    """Per request, its top K continuations (best first) over all its live beams.

    `logits` holds one row per live beam, requests one after another in `groups` order, beams
    in each request's `live` order."""
    widths = [len(g.live) for g in groups]
    k_max = min(max(g.num_candidates for g in groups), logits.shape[-1])
    rows = logits.float()
    if any(t > 0 and t != 1.0 for t in temperature):
        scale = torch.tensor([t if t > 0 else 1.0 for t in temperature], device=rows.device)
        rows = rows / scale[:, None]
    cumulative = torch.tensor([b.cumulative_logprob for g in groups for b in g.live],
                              dtype=torch.float32, device=rows.device)
    # log_softmax is the logits minus a per-row constant: rank the raw row, shift the winners
    # (two passes over the vocabulary instead of four full-size temporaries).
    values, token_ids = rows.topk(k_max, dim=-1)
    values = values - torch.logsumexp(rows, dim=-1, keepdim=True) + cumulative[:, None]
    per_group_values, per_group_index = _top_per_group(values, widths, k_max)
    return _candidates(groups, widths, k_max, per_group_values, per_group_index, token_ids)


def _top_per_group(values: torch.Tensor, widths: list[int], k_max: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """[G, k_max] best flat (beam * k_max + rank) positions among each group's beam rows."""
    w_max = max(widths)
    padded = torch.full((len(widths), w_max, k_max), float("-inf"), device=values.device)
    row_of = torch.tensor([[g, b] for g, w in enumerate(widths) for b in range(w)],
                          device=values.device)
    padded[row_of[:, 0], row_of[:, 1]] = values
    return padded.view(len(widths), w_max * k_max).topk(k_max, dim=-1)


def _candidates(groups: list[BeamState], widths: list[int], k_max: int, values: torch.Tensor,
                flat: torch.Tensor, token_ids: torch.Tensor) -> list[list[Candidate]]:
    starts = [0]
    for w in widths:
        starts.append(starts[-1] + w)
    beam = flat // k_max
    rank = flat % k_max
    row = beam + torch.tensor(starts[:-1], device=flat.device)[:, None]
    tokens = token_ids[row.clamp_max(token_ids.shape[0] - 1), rank].tolist()
    values, beam = values.tolist(), beam.tolist()
    result = []
    for g, group in enumerate(groups):
        count = min(group.num_candidates, k_max)
        result.append([Candidate(group.live[beam[g][i]], tokens[g][i], values[g][i])
                       for i in range(count) if beam[g][i] < widths[g]
                       and values[g][i] != float("-inf")])
    return result


def advance(state: BeamState, candidates: list[Candidate]) -> BeamStep:
    """Applies one step's ranked candidates to the request (transformers' order of updates)."""
    generated = state.generated + 1
    at_limit = generated >= state.max_tokens
    eos = frozenset() if state.params.ignore_eos else state.eos_token_ids
    may_add = state.improvable and not (state.params.early_stopping is True and state.full())
    next_beams, new = [], []
    for rank, cand in enumerate(candidates):
        ends = at_limit or cand.token in eos
        if not ends:
            if len(next_beams) < state.width:
                next_beams.append(cand)
        elif rank < state.width and may_add:
            new.append(_hypothesis(state, cand, generated))
    _merge(state, new)
    state.generated = generated
    if at_limit or not next_beams:
        state.done = True
        return BeamStep([])
    state.improvable = _improvable(state, next_beams[0].cumulative_logprob)
    if not state.improvable or (state.params.early_stopping is True and state.full()):
        state.done = True
        return BeamStep([])
    return BeamStep(next_beams)


def _hypothesis(state: BeamState, cand: Candidate, generated: int) -> Hypothesis:
    tokens = cand.parent.token_ids[cand.parent.prompt_len:] + [cand.token]
    reason = "length" if cand.token not in state.eos_token_ids or state.params.ignore_eos \
        else "stop"
    score = cand.cumulative_logprob / generated ** state.params.length_penalty
    return Hypothesis(tokens, cand.cumulative_logprob, score, reason)


def _merge(state: BeamState, new: list[Hypothesis]) -> None:
    # Stable sort with the kept ones first: on equal scores the older hypothesis stays ahead,
    # as in transformers' top-k over (kept, new).
    merged = sorted(state.hypotheses + new, key=lambda h: -h.score)
    state.hypotheses = merged[:state.width]


def _improvable(state: BeamState, best_live: float) -> bool:
    """Can the best live beam still beat the worst kept hypothesis? (transformers' heuristic)"""
    if not state.full():
        return True
    penalty = state.params.length_penalty
    if state.params.early_stopping == "never" and penalty > 0.0:
        best_possible = best_live / state.max_tokens ** penalty
    else:
        best_possible = best_live / state.generated ** penalty
    return best_possible > state.hypotheses[-1].score
