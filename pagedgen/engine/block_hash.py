"""Chained hashes that identify full KV blocks for prefix caching.

A block's identity is (parent block's hash, its own token ids, an extra key such as a model
salt): chaining through the parent makes the hash stand for the whole prefix up to and including
the block, so two equal blocks after different prefixes never match. The hash value is Python's
64-bit tuple hash; because a hash can collide, `BlockHash` keeps the token ids and extra key it
was made from and a lookup accepts a block only if those compare equal too. What is not verified
is the parent's *content* (only its hash value), which leaves a 2**-64-scale risk per lookup that
two different prefixes collide on a parent hash — the same trade vLLM makes with its hashes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class BlockHash:
    """The hash of one full block plus what it was computed from (for verification)."""

    value: int
    # (parent hash value or None for a first block, token ids, extra key). A plain tuple on
    # purpose: the pool keeps one per cached block, and CPython's garbage collector stops
    # tracking tuples of ints, where a million dataclass instances would make every full
    # collection walk them all, slowing every engine operation on large pools.
    key: tuple[int | None, tuple[int, ...], object]

    @property
    def parent(self) -> int | None:
        return self.key[0]

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.key[1]

    @property
    def extra_key(self) -> object:
        return self.key[2]


def hash_block(parent: int | None, token_ids: Sequence[int], extra_key: object) -> BlockHash:
    """Hash one full block given the hash value of the block before it."""
    key = (parent, as_token_ids(token_ids), extra_key)
    return BlockHash(hash(key), key)


def iter_block_hashes(
    token_ids: Sequence[int], block_size: int, num_blocks: int, extra_key: object,
    parent: int | None = None,
) -> Iterator[BlockHash]:
    """Lazily hash the first `num_blocks` full blocks of `token_ids`, chained from `parent`.

    Lazy so that a prefix lookup stops hashing at the first miss.
    """
    for start in range(0, num_blocks * block_size, block_size):
        block_hash = hash_block(parent, token_ids[start:start + block_size], extra_key)
        parent = block_hash.value
        yield block_hash


def as_token_ids(token_ids: Sequence[int]) -> tuple[int, ...]:
    """Token ids as a tuple of plain ints; TypeError naming token_ids for anything else."""
    # operator.index rejects floats and strings, and turns numpy/torch integer scalars into
    # plain ints (a torch scalar hashes by identity, which would silently defeat caching).
    try:
        return tuple(map(operator.index, token_ids))
    except TypeError as error:
        raise TypeError(f"token_ids must be integers: {error}") from None
