"""A persistent, content-addressed store of full KV blocks on disk (docs/prefix_store.md).

No engine coupling: the store knows keys (32-byte digests) and payloads (bytes); the KV manager
link (engine/store_link.py) and the runner turn blocks into those.
"""

from .block_file import BlockFileError
from .identity import StoreIdentity, file_content_digest
from .keys import block_keys
from .store import BlockStore, StoreStats, VerifyResult
from .writer import BlockWriter, WriterCounters

__all__ = ["BlockFileError", "BlockStore", "BlockWriter", "StoreIdentity", "StoreStats",
           "VerifyResult", "WriterCounters", "block_keys", "file_content_digest"]
