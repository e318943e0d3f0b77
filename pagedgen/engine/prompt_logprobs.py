"""Prompt logprobs (vLLM's shape): None for the first prompt token, then per position a dict
token id -> Logprob holding the actual token and the top-k, with ranks.

The runner keeps the hidden states of the chunks that score prompt positions; the logits
are computed here a slice of rows at a time, so a long prompt never holds [prompt, vocab]
float32 logits at once (49k-token vocabularies make that 200 kB per token). Positions already
scored are skipped, so a re-prefill after a preemption, or a sibling sample, adds nothing twice.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedgen.engine.outputs import Logprob
from pagedgen.engine.sampler import top_logprobs
from pagedgen.engine.sequence import SequenceGroup
from pagedgen.model.runtime.batch import ScheduledChunk

ROWS_PER_SLICE = 128


def record_prompt_logprobs(runner: Any, seqs: list, chunks: list[ScheduledChunk]) -> None:
    """Scores the prompt positions predicted by this step's prompt_logprobs chunks."""
    asked = [(seq, chunk) for seq, chunk in zip(seqs, chunks) if chunk.prompt_logprobs]
    for (seq, chunk), hidden in zip(asked, runner.prompt_hidden):
        _score_chunk(runner, seq.group, chunk.start_pos, hidden)


@torch.inference_mode()
def _score_chunk(runner: Any, group: SequenceGroup, start: int, hidden: torch.Tensor) -> None:
    """Row r of the chunk (absolute position start + r) predicts prompt position start + r + 1."""
    first = len(group.prompt_logprobs)
    stop = min(start + hidden.shape[0], len(group.prompt_token_ids) - 1)
    for low in range(first, stop + 1, ROWS_PER_SLICE):
        high = min(low + ROWS_PER_SLICE, stop + 1)
        logits = runner.compute_logits(hidden[low - 1 - start:high - 1 - start])
        group.prompt_logprobs += _entries(logits, group.prompt_token_ids[low:high],
                                          group.params.prompt_logprobs)


def _entries(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, Logprob]]:
    logprobs = logits.float().log_softmax(dim=-1)
    actual = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, actual[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_ids, top_values = top_logprobs(logprobs, actual, k)
    entries = []
    for token, value, rank, ids, values in zip(targets, chosen.squeeze(1).tolist(), ranks,
                                               top_ids.tolist(), top_values.tolist()):
        entry = {t: Logprob(v, r + 1) for r, (t, v) in enumerate(zip(ids, values))}
        entry.setdefault(token, Logprob(value, rank))
        entries.append(entry)
    return entries
