"""What makes a stored block's bytes valid, hashed into the root of every block key.

Two runs may share a block only if their K/V for the same tokens are bitwise the same: same
weights (a full content hash of the model files: a partial digest could let an edited file
serve old K/V, a silent wrong answer), same weights format, compute dtype, KV format (8-bit
codes and their scales), block size, layer layout and rope settings, and the same kernel path
(the CPU's instruction set changes the bits of a bf16 product) and batch-invariant mode.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .atomic import write_atomically


@dataclass(frozen=True, slots=True)
class StoreIdentity:
    model_digest: str          # file_content_digest of the model's files
    weights_format: str        # "gguf" | "hf"
    dtype: str                 # compute dtype, e.g. "bfloat16"
    kv_cache_dtype: str        # "auto" or an 8-bit format
    block_size: int
    layers: str                # layer-group layout: layers, KV heads, head dim, attention kinds
    rope: str                  # rope theta and scaling
    kernel_path: str           # device and CPU instruction-set path that computed the K/V
    batch_invariant: bool

    @property
    def root(self) -> bytes:
        """The 32-byte root of the key chain."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(b"pagedgen-kv-store-v1\0" + text.encode(), digest_size=32).digest()

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def file_content_digest(paths: list[Path], cache_folder: Path | None = None) -> str:
    """BLAKE2b over the files' names and full contents. Cached in cache_folder under each file's
    (device, inode, size, mtime): a changed file gets a new stat, so it is hashed again."""
    digest = hashlib.blake2b(digest_size=32)
    for path in sorted(Path(p) for p in paths):
        digest.update(path.name.encode() + b"\0")
        digest.update(bytes.fromhex(_one_file_digest(path, cache_folder)))
    return digest.hexdigest()


def _one_file_digest(path: Path, cache_folder: Path | None) -> str:
    info = path.stat()
    stamp = f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}:{path.resolve()}"
    cached = None
    if cache_folder is not None:
        cached = cache_folder / (hashlib.blake2b(stamp.encode(), digest_size=16).hexdigest() + ".txt")
        try:
            text = cached.read_text().split()
            if len(text) == 2 and text[1] == hashlib.sha256(stamp.encode()).hexdigest():
                return text[0]
        except (OSError, UnicodeDecodeError):
            pass
    with open(path, "rb") as handle:
        value = hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=32)).hexdigest()
    if cached is not None:
        try:
            write_atomically(cached, f"{value} {hashlib.sha256(stamp.encode()).hexdigest()}\n".encode())
        except OSError:
            pass  # a read-only store still works, it hashes again next time
    return value
