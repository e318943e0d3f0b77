"""The vectorized sampler: one call per engine step turns a [rows, vocab] logits tensor into one
token per row, each row with its own temperature / top-k / top-p / min-p / penalties / seed.

Order of operations (vLLM's): penalties and min_tokens bans on the logits, then temperature,
min-p, top-k, top-p, and a draw. Greedy rows take the argmax and skip everything random.

The draw is an inverse-CDF lookup with ONE uniform number per row and step. That number comes
from the row's own generator when the request is seeded, so a seeded request consumes the same
random stream whatever else is in the batch, and sample i of an n > 1 request has its own
stream. Same tokens follow exactly only in float32 or with batch_invariant: otherwise, in
bfloat16, the model's logits depend in their last bits on the batch composition (GEMM blocking
changes with the row count), so the same uniform number can land on a different token and the
continuations can diverge. Every step here is per row, except the candidate count (the step's
largest top_k when above CANDIDATES), which can move a top-p / min-p row's draw.

Speed: sorting a [256, 49152] logits tensor costs ~20 lm_head matmuls on this CPU, so each
random row is first settled among its top CANDIDATES tokens (one topk): exact whenever the
row's surviving tokens provably lie inside them (top-k, a min-p cut, or a top-p nucleus that
closes within them, measured against the full-row normalizer). The other rows (plain
temperature sampling, very wide nuclei) take the full-vocabulary path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from pagedgen.engine.sampling_params import SamplingParams
from pagedgen.kernels.cpu import backend as cpu_backend

# Top tokens examined first. A top_p <= 0.95 nucleus of a trained LM almost always fits.
CANDIDATES = 256


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
class RandomRows:
    """The rows that sample at random, and their filters (tensors over those rows only)."""

    index: torch.Tensor | None      # their positions in the batch; None: every row
    temperature: torch.Tensor
    top_k: torch.Tensor | None      # int64, 0 = off; None: off for all
    top_p: torch.Tensor | None      # None: 1.0 for all
    min_p: torch.Tensor | None      # None: 0.0 for all
    seeded: list[tuple[int, torch.Generator]]   # (position among these rows, generator)

    def select(self, rows: torch.Tensor) -> RandomRows:
        pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
        return RandomRows(None, pick(self.temperature), pick(self.top_k), pick(self.top_p),
                          pick(self.min_p), [])


@dataclass(slots=True)
class SamplingBatch:
    random: RandomRows | None                          # None: every row is greedy
    penalties: PenaltyInputs | None
    banned: tuple[torch.Tensor, torch.Tensor] | None   # (rows, token ids) to mask with -inf
    logprob_rows: list[int]
    max_logprobs: int


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # The rest is filled for logprob_rows only, in that order (raw model distribution).
    logprobs: list[float] | None = None          # log-probability of the sampled token
    ranks: list[int] | None = None               # its rank (1 = most likely)
    top_ids: list[list[int]] | None = None       # top max_logprobs token ids
    top_logprobs: list[list[float]] | None = None


# --- building a batch ---

def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _pad(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(x) for x in lists))
    return _column([x + [pad] * (width - len(x)) for x in lists], torch.int64, device)


def build_batch(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str) -> SamplingBatch:
    """Gathers the per-row parameters into tensors; what no row uses costs nothing."""
    device = torch.device(device)
    params = [r.params for r in rows]
    return SamplingBatch(
        random=_random_rows(rows, vocab_size, device),
        penalties=_penalty_inputs(rows, vocab_size, device),
        banned=_banned(rows, device),
        logprob_rows=[i for i, p in enumerate(params) if p.logprobs is not None],
        max_logprobs=max((p.logprobs or 0 for p in params), default=0),
    )


def _random_rows(rows: Sequence[SamplingRow], vocab_size: int, device) -> RandomRows | None:
    positions = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not positions:
        return None
    params = [rows[i].params for i in positions]
    top_k = [min(p.top_k, vocab_size) for p in params]
    return RandomRows(
        index=None if len(positions) == len(rows) else _column(positions, torch.int64, device),
        temperature=_column([p.temperature for p in params], torch.float32, device),
        top_k=_column(top_k, torch.int64, device) if any(top_k) else None,
        top_p=_optional([p.top_p for p in params], 1.0, device),
        min_p=_optional([p.min_p for p in params], 0.0, device),
        seeded=[(j, rows[i].generator) for j, i in enumerate(positions)
                if rows[i].generator is not None],
    )


def _optional(values: list[float], neutral: float, device) -> torch.Tensor | None:
    if all(v == neutral for v in values):
        return None
    return _column(values, torch.float32, device)


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


# --- logits processing ---

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
    """Full-vocabulary top-k (0 = off) and top-p masks with one sort, as vLLM does. The slow but
    general path: the sampler first tries to settle rows within their top candidates."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        first_kept = torch.where(top_k == 0, 0, vocab - top_k)
        threshold = sorted_logits.gather(1, first_kept[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1 - top_p)[:, None]
        outside[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from softmax(logits) per row, using the row's uniform number in [0, 1).
    The weights stay unnormalized: the target is scaled by their total instead."""
    top = logits.amax(dim=-1, keepdim=True)
    cumulative = (logits - top).exp_().cumsum_(dim=-1)   # the weights, accumulated in place
    target = (uniforms * cumulative[:, -1])[:, None]
    index = torch.searchsorted(cumulative, target, right=True).clamp_max_(logits.shape[-1] - 1)
    # Only float rounding at the very top of the CDF can land on a zero-weight entry. The
    # landed weight is recomputed as the pass computed it (exp is elementwise); the argmax
    # that replaces it is a full pass over the row, so it runs for those rare rows alone.
    landed_on_zero = ((logits.gather(1, index) - top).exp_() <= 0).squeeze(1)
    if bool(landed_on_zero.any()):
        rows = landed_on_zero.nonzero().squeeze(1)
        index[rows] = (logits[rows] - top[rows]).exp_().argmax(dim=-1, keepdim=True)
    return index.squeeze(1)


def scale_by_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / temperature per row. When every row's temperature is 1 the division is an exact
    no-op (x / 1.0 == x in IEEE arithmetic), so the logits come back as they are, without a
    full-vocabulary pass."""
    if bool((temperature == 1).all()):
        return logits
    return logits / temperature[:, None]


# --- random choice ---

def sample_random(logits: torch.Tensor, rows: RandomRows, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` (all rows random) under the rows' filters."""
    if rows.top_k is None and rows.top_p is None and rows.min_p is None:
        return _sample_full_vocab(logits, rows, uniforms)  # nothing to settle among candidates
    vocab = logits.shape[-1]
    k = min(vocab, max(CANDIDATES, int(rows.top_k.max()) if rows.top_k is not None else 0))
    values, ids = logits.topk(k, dim=-1)          # descending; a temperature keeps the order
    scaled = values / rows.temperature[:, None]
    keep, settled = _filter_candidates(scaled, logits, rows)
    choice = inverse_cdf(scaled.masked_fill(~keep, float("-inf")), uniforms)
    tokens = ids.gather(1, choice[:, None]).squeeze(1)
    if not bool(settled.all()):
        wide = (~settled).nonzero().squeeze(1)
        tokens[wide] = _sample_full_vocab(logits[wide], rows.select(wide), uniforms[wide])
    return tokens


def _filter_candidates(scaled: torch.Tensor, logits: torch.Tensor,
                       rows: RandomRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep mask over the candidates, rows whose every surviving token is a candidate)."""
    num_rows, k = scaled.shape
    keep = torch.ones_like(scaled, dtype=torch.bool)
    settled = torch.full((num_rows,), k == logits.shape[-1], dtype=torch.bool, device=scaled.device)
    if rows.min_p is not None:
        keep &= scaled >= scaled[:, :1] + rows.min_p.log()[:, None]
        settled |= ~keep[:, -1]       # the cut fell inside the candidates
    if rows.top_k is not None:
        has_k = rows.top_k > 0
        limit = torch.where(has_k, rows.top_k, k)
        keep &= torch.arange(k, device=scaled.device)[None, :] < limit[:, None]
        settled |= has_k
    if rows.top_p is not None:
        settled = _nucleus(scaled, logits, rows, keep, settled)
    return keep, settled


def _nucleus(scaled: torch.Tensor, logits: torch.Tensor, rows: RandomRows, keep: torch.Tensor,
             settled: torch.Tensor) -> torch.Tensor:
    """Narrows `keep` (in place) to each top-p row's nucleus; returns the updated `settled`.
    Settled rows normalize over their candidates; the others over their full row."""
    top_p = rows.top_p
    log_norm = torch.logsumexp(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    wide = ~settled & (top_p < 1)
    if bool(wide.any()):
        index = wide.nonzero().squeeze(1)
        full = logits[index] / rows.temperature[index, None]
        if rows.min_p is not None:
            full = apply_min_p(full, rows.min_p[index])
        log_norm[index] = torch.logsumexp(full, dim=-1)
    probs = (scaled - log_norm[:, None]).exp().masked_fill_(~keep, 0.0)
    cumulative = probs.cumsum(dim=-1)
    active = top_p < 1
    # A token stays when the mass strictly above it is below top_p (the top token always does).
    keep &= ~active[:, None] | ((cumulative - probs) < top_p[:, None])
    return settled | (active & (cumulative[:, -1] >= top_p))


def _sample_full_vocab(logits: torch.Tensor, rows: RandomRows, uniforms: torch.Tensor) -> torch.Tensor:
    """Rows not settled among candidates (no top-k by construction)."""
    scaled = scale_by_temperature(logits, rows.temperature)
    if rows.min_p is not None:
        scaled = apply_min_p(scaled, rows.min_p)
    if rows.top_p is not None and bool((rows.top_p < 1).any()):
        scaled = apply_top_k_top_p(scaled, None, rows.top_p)
    return inverse_cdf(scaled, uniforms)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary, first index on ties (as argmax). On CPU one native pass per
    row (a 262k vocabulary makes torch's reduction a visible share of a decode step), else
    max(dim).indices, the faster of torch's two (bench/FIGURES.md)."""
    native = cpu_backend.argmax_rows(logits)
    return logits.max(dim=-1).indices if native is None else native


# --- the sampler ---

class Sampler:
    """Stateless apart from the engine generator, which draws for unseeded rows."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    @torch.inference_mode()  # the runner's logits are inference tensors: edit them in that mode
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits.float()
        processed = self._constrain(raw, batch)
        tokens = self._choose(processed, batch.random)
        output = SamplerOutput(tokens.tolist())
        if batch.logprob_rows:
            self._logprobs(raw, tokens, batch, output)
        return output

    @staticmethod
    def _constrain(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.penalties is None and batch.banned is None:
            return logits
        if batch.logprob_rows:
            logits = logits.clone()  # logprobs are reported on the raw logits
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        if batch.banned is not None:
            logits[batch.banned] = float("-inf")
        return logits

    def _choose(self, logits: torch.Tensor, random: RandomRows | None) -> torch.Tensor:
        if random is None:
            return greedy(logits)
        uniforms = self._uniforms(random, logits.device)
        if random.index is None:
            return sample_random(logits, random, uniforms)
        tokens = greedy(logits)
        chosen = sample_random(logits.index_select(0, random.index), random, uniforms)
        return tokens.index_copy_(0, random.index, chosen)

    def _uniforms(self, random: RandomRows, device: torch.device) -> torch.Tensor:
        """One draw per random row: from the engine generator, or the row's own when seeded."""
        uniforms = torch.rand(random.temperature.shape[0], generator=self.generator, device=device)
        if random.seeded:  # one draw per seeded row (not per token), written back in one copy
            positions = torch.tensor([p for p, _ in random.seeded], device=device)
            own = torch.cat([torch.rand(1, generator=g, device=device) for _, g in random.seeded])
            uniforms.index_copy_(0, positions, own)
        return uniforms

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch,
                  output: SamplerOutput) -> None:
        rows = torch.tensor(batch.logprob_rows, device=raw.device)
        logprobs = raw.index_select(0, rows).log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens.index_select(0, rows)[:, None])
        output.logprobs = chosen.squeeze(1).tolist()
        output.ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        top_ids, top_values = top_logprobs(logprobs, tokens.index_select(0, rows), batch.max_logprobs)
        output.top_ids, output.top_logprobs = top_ids.tolist(), top_values.tolist()


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely token ids per row and their logprobs, ties broken deterministically:
    the chosen token first among its equals, then lower ids first (argmax's rule).

    topk's order among equal values is unspecified, and bf16 logits tie often; without this a
    greedy token could be reported at rank 1 while another token heads the top list. With it
    the chosen token sits at position `rank` (the count of strictly larger logprobs + 1).
    """
    values, ids = logprobs.topk(k, dim=-1)
    if k == 0:
        return ids, values
    # Ties at the cut may hold the chosen token outside topk's pick: widen to every tied value.
    width = int((logprobs >= values[:, -1:]).sum(dim=-1).max())
    if width > k:
        values, ids = logprobs.topk(width, dim=-1)
    # Stable sorts, least significant key first: id, then chosen-first, then logprob.
    order = ids.argsort(dim=-1)
    not_chosen = (ids.gather(1, order) != chosen[:, None]).to(torch.int8)
    order = order.gather(1, not_chosen.argsort(dim=-1, stable=True))
    order = order.gather(1, values.gather(1, order).argsort(dim=-1, descending=True, stable=True))
    return ids.gather(1, order[:, :k]), values.gather(1, order[:, :k])
