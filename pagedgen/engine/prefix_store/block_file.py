"""The bytes of one stored block: a fixed 128-byte header, then the payload.

Header (little-endian): magic b"PGKVBLK\\0", format version (u16), header size (u16), the
block's 32-byte key, payload size (u64), and a CRC-32 (u32) over everything before it plus the
payload. The key inside the file makes a block copied or renamed under another key a miss; the
checksum makes a torn, truncated or flipped file a miss.

Why CRC-32 and not a cryptographic hash: the checksum guards against accidents (torn writes,
truncation, flipped bits: CRC-32 catches every burst of up to 32 bits and all but 2^-32 of
random damage), while forged files are kept out by the private folder. The background writer
computes it on the same cores as the engine's threads, and a cryptographic hash is several
times slower there (figures in docs/prefix_store.md). Files of format 1 (BLAKE2b) are misses.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"PGKVBLK\0"
VERSION = 2                           # 1: BLAKE2b-256 checksums
HEADER_SIZE = 128
KEY_SIZE = 32
_PREFIX = struct.Struct("<8sHH32sQ")  # magic, version, header size, key, payload size
_CHECKSUM = struct.Struct("<I")
_CHECKSUM_AT = _PREFIX.size
_PAD = HEADER_SIZE - _PREFIX.size - _CHECKSUM.size


class BlockFileError(ValueError):
    """A block file that must not be used (its text says why)."""


def encode(key: bytes, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The file's content as [header, payload] (written with one writelines, no joined copy)."""
    _check_key(key)
    prefix = _PREFIX.pack(MAGIC, VERSION, HEADER_SIZE, key, len(payload))
    checksum = _checksum(prefix, payload)
    return [prefix + checksum + bytes(_PAD), payload]


def decode(data: bytes | memoryview, key: bytes, payload_size: int | None = None) -> memoryview:
    """The payload of a block file read whole, after checking that it is the block `key` asks
    for, whole and unchanged; BlockFileError otherwise."""
    view = memoryview(data)
    stored_key, size = read_header(view)
    if stored_key != key:
        raise BlockFileError("the file holds another key's block")
    if payload_size is not None and size != payload_size:
        raise BlockFileError(f"payload of {size} bytes, expected {payload_size}")
    return _checked_payload(view, size)


def verify(data: bytes | memoryview) -> bytes:
    """The key of a whole, unchanged block file (for `pagedgen store verify`)."""
    view = memoryview(data)
    key, size = read_header(view)
    _checked_payload(view, size)
    return key


def read_header(view: memoryview) -> tuple[bytes, int]:
    if len(view) < HEADER_SIZE:
        raise BlockFileError(f"truncated: {len(view)} bytes, shorter than the header")
    magic, version, header_size, key, size = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise BlockFileError("not a pagedgen KV block file")
    if version != VERSION or header_size != HEADER_SIZE:
        raise BlockFileError(f"format version {version}, this pagedgen reads {VERSION}")
    return bytes(key), size


def _checked_payload(view: memoryview, size: int) -> memoryview:
    if len(view) != HEADER_SIZE + size:
        raise BlockFileError(f"{len(view)} bytes, the header announces {HEADER_SIZE + size}")
    payload = view[HEADER_SIZE:]
    expected = bytes(view[_CHECKSUM_AT:_CHECKSUM_AT + _CHECKSUM.size])
    if _checksum(view[:_CHECKSUM_AT], payload) != expected:
        raise BlockFileError("checksum mismatch (corrupted or torn)")
    return payload


def _checksum(prefix: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    return _CHECKSUM.pack(zlib.crc32(payload, zlib.crc32(prefix)))


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_SIZE:
        raise ValueError(f"a block key is {KEY_SIZE} bytes, got {key!r:.40}")
