"""Block keys: a chain of BLAKE2b digests over the prompt's token ids, rooted in the identity.

Key of block i = BLAKE2b(key of block i-1 (the identity's root for block 0) || block i's token
ids as little-endian int64). Unlike the in-memory prefix hash (Python's 64-bit tuple hash of a
string-salted tuple, which changes with the process's hash seed), this is the same in every
process and on every machine, and 256 bits leave no collision to worry about.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent + data, digest_size=32).digest()


def block_keys(root: bytes, token_ids: Sequence[int], block_size: int,
               num_blocks: int) -> Iterator[bytes]:
    """Lazily, the keys of the first num_blocks full blocks of token_ids (stop at a miss)."""
    parent = root
    for start in range(0, num_blocks * block_size, block_size):
        parent = block_key(parent, token_ids[start:start + block_size])
        yield parent
