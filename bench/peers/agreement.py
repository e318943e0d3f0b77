"""Greedy token agreement between two engines' outputs (informational: bf16 rounding differs
between kernels, and one flipped argmax changes everything after it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Agreement:
    prefix: float        # tokens before each request's first mismatch / all tokens
    exact: float         # requests whose whole output matches
    first_token: float   # requests whose first generated token matches (prefill logits)


def common_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> Agreement:
    if len(outputs) != len(reference):
        raise ValueError(f"agreement: {len(outputs)} outputs vs {len(reference)} reference outputs")
    total = sum(len(r) for r in reference) or 1
    prefixes = [common_prefix(o, r) for o, r in zip(outputs, reference)]
    return Agreement(
        prefix=sum(prefixes) / total,
        exact=sum(o == r for o, r in zip(outputs, reference)) / len(reference),
        first_token=sum(bool(o[:1]) and o[:1] == r[:1] for o, r in zip(outputs, reference)) / len(reference),
    )
