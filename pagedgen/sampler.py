"""The vectorized sampler: one call per engine step turns a [rows, vocab] logits tensor into one
token per row, each row with its own temperature / top-k / top-p / min-p / penalties / seed.

Random choice uses the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with
probability p_i. Its only randomness is the noise tensor, so a seeded row draws its noise from its
own generator and gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from pagedgen.sampling import SamplingParams

# Noise of exactly 0 would make p/E infinite (or nan for p = 0, which argmax would pick).
_MIN_NOISE = 1e-20


class SamplingRow(Protocol):
    """What the sampler needs to know about the sequence behind one logits row."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]
    prompt_len: int

    def banned_token_ids(self) -> list[int]: ...  # stop tokens masked until min_tokens is reached


@dataclass(slots=True)
class PenaltyInputs:
    prompt_ids: torch.Tensor        # [R, Lp] int64, padded with vocab_size
    output_ids: torch.Tensor        # [R, Lo] int64, padded with vocab_size
    presence: torch.Tensor          # [R] float32
    frequency: torch.Tensor         # [R]
    repetition: torch.Tensor        # [R]


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor | None       # [R]; None when every row is greedy
    greedy: torch.Tensor | None            # [R] bool; None when no row is greedy
    top_k: torch.Tensor | None             # [R] int64, 0 where off; None when all off
    top_p: torch.Tensor | None             # [R]; None when all rows use 1.0
    min_p: torch.Tensor | None             # [R]; None when all rows use 0.0
    seeded: list[tuple[int, torch.Generator]]
    penalties: PenaltyInputs | None
    banned: tuple[torch.Tensor, torch.Tensor] | None   # (rows, token ids) to mask with -inf
    logprob_rows: list[int]
    max_logprobs: int


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]                  # raw log-probability of each sampled token
    top_ids: list[list[int]] | None        # per row of logprob_rows: top-k token ids
    top_logprobs: list[list[float]] | None
    ranks: list[int] | None                # rank of the sampled token (1 = most likely)


def _pad(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.int64, device=device)


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def build_batch(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str) -> SamplingBatch:
    """Gathers the per-row parameters into tensors; rows that need nothing special cost nothing."""
    device = torch.device(device)
    params = [r.params for r in rows]
    greedy = [p.greedy for p in params]
    any_random = not all(greedy)
    return SamplingBatch(
        temperature=_column([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                            torch.float32, device) if any_random else None,
        greedy=_column(greedy, torch.bool, device) if any(greedy) and any_random else None,
        top_k=_optional_top_k(params, vocab_size, device) if any_random else None,
        top_p=_optional(params, "top_p", 1.0, device) if any_random else None,
        min_p=_optional(params, "min_p", 0.0, device) if any_random else None,
        seeded=[(i, r.generator) for i, r in enumerate(rows)
                if r.generator is not None and not r.params.greedy],
        penalties=_penalty_inputs(rows, vocab_size, device),
        banned=_banned(rows, device),
        logprob_rows=[i for i, p in enumerate(params) if p.logprobs is not None],
        max_logprobs=max((p.logprobs or 0 for p in params), default=0),
    )


def _optional(params: list[SamplingParams], name: str, neutral: float, device) -> torch.Tensor | None:
    values = [getattr(p, name) for p in params]
    if all(v == neutral for v in values):
        return None
    return _column(values, torch.float32, device)


def _optional_top_k(params: list[SamplingParams], vocab_size: int, device) -> torch.Tensor | None:
    if all(p.top_k == 0 for p in params):
        return None
    return _column([min(p.top_k, vocab_size) for p in params], torch.int64, device)


def _penalty_inputs(rows: Sequence[SamplingRow], vocab_size: int, device) -> PenaltyInputs | None:
    used = [r.params.uses_penalties for r in rows]
    if not any(used):
        return None
    # Rows without penalties get empty id lists: their neutral factors leave them unchanged anyway.
    prompts = [r.token_ids[:r.prompt_len] if u else [] for r, u in zip(rows, used)]
    outputs = [r.token_ids[r.prompt_len:] if u else [] for r, u in zip(rows, used)]
    params = [r.params for r in rows]
    return PenaltyInputs(
        prompt_ids=_pad(prompts, vocab_size, device),
        output_ids=_pad(outputs, vocab_size, device),
        presence=_column([p.presence_penalty for p in params], torch.float32, device),
        frequency=_column([p.frequency_penalty for p in params], torch.float32, device),
        repetition=_column([p.repetition_penalty for p in params], torch.float32, device),
    )


def _banned(rows: Sequence[SamplingRow], device) -> tuple[torch.Tensor, torch.Tensor] | None:
    banned = [r.banned_token_ids() for r in rows]
    if not any(banned):
        return None
    row_idx = [i for i, ids in enumerate(banned) for _ in ids]
    token_idx = [t for ids in banned for t in ids]
    return _column(row_idx, torch.int64, device), _column(token_idx, torch.int64, device)


def apply_penalties(logits: torch.Tensor, pen: PenaltyInputs) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output tokens, then frequency and presence over the
    output tokens only. Works in place on `logits` and returns it."""
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, pen.output_ids, torch.ones_like(pen.output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    in_prompt = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, pen.prompt_ids, True)
    seen = in_prompt[:, :vocab] | (counts > 0)
    rep = pen.repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits -= pen.frequency[:, None] * counts
    logits -= pen.presence[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the top token's (p_i < min_p * p_max
    is logit_i < logit_max + log(min_p); min_p = 0 gives -inf, i.e. no mask)."""
    floor = logits.max(dim=-1, keepdim=True).values + min_p.log()[:, None]
    return logits.masked_fill(logits < floor, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks (with -inf) tokens outside each row's top-k (0 = off) and its top-p nucleus."""
    if top_p is None:
        # top-k alone needs no full sort: the k-th largest value is a per-row threshold.
        top_values = logits.topk(int(top_k.max()), dim=-1).values
        threshold = top_values.gather(1, (top_k - 1).clamp_min(0)[:, None])
        threshold = threshold.masked_fill(top_k[:, None] == 0, float("-inf"))
        return logits.masked_fill(logits < threshold, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1)  # ascending, as vLLM does
    vocab = logits.shape[-1]
    if top_k is not None:
        first_kept = torch.where(top_k == 0, 0, vocab - top_k)
        threshold = sorted_logits.gather(1, first_kept[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1 - top_p)[:, None]
    outside[:, -1] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Stateless apart from the engine generator used by unseeded rows."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        log_norm = torch.logsumexp(logits, dim=-1)
        processed = self._constrain(logits, batch)
        tokens = self._choose(processed, batch)
        chosen_logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - log_norm
        output = SamplerOutput(tokens.tolist(), chosen_logprobs.tolist(), None, None, None)
        if batch.logprob_rows:
            self._top_logprobs(logits, log_norm, tokens, batch, output)
        return output

    @staticmethod
    def _constrain(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.penalties is None and batch.banned is None:
            return logits
        logits = logits.clone()  # the raw logits still serve the logprobs
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        if batch.banned is not None:
            logits[batch.banned] = float("-inf")
        return logits

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.temperature is None:
            return logits.argmax(dim=-1)
        scaled = logits / batch.temperature[:, None]
        if batch.min_p is not None:  # vLLM's order: temperature, min-p, then top-k/top-p
            scaled = apply_min_p(scaled, batch.min_p)
        if batch.top_k is not None or batch.top_p is not None:
            scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
        probs = scaled.softmax(dim=-1)
        sampled = (probs / self._noise(probs, batch.seeded)).argmax(dim=-1)
        if batch.greedy is None:
            return sampled
        return torch.where(batch.greedy, logits.argmax(dim=-1), sampled)

    def _noise(self, probs: torch.Tensor, seeded: list[tuple[int, torch.Generator]]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in seeded:  # one loop iteration per seeded row, not per token
            noise[row].exponential_(generator=generator)
        return noise.clamp_min_(_MIN_NOISE)

    @staticmethod
    def _top_logprobs(logits, log_norm, tokens, batch: SamplingBatch, output: SamplerOutput) -> None:
        rows = torch.tensor(batch.logprob_rows, device=logits.device)
        logprobs = logits[rows] - log_norm[rows, None]
        chosen = logprobs.gather(1, tokens[rows][:, None])
        output.ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        if batch.max_logprobs == 0:
            output.top_ids, output.top_logprobs = [[] for _ in batch.logprob_rows], [[] for _ in batch.logprob_rows]
            return
        top = logprobs.topk(batch.max_logprobs, dim=-1)
        output.top_ids, output.top_logprobs = top.indices.tolist(), top.values.tolist()
