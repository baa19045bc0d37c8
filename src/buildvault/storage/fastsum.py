"""XXH3-64: the fast checksum a store keeps for bytes whose digest was verified (issue 35).

A blob's digest is verified once, when it is written; the store records this checksum of the
same bytes then, and a whole read checks it (about 10 GB/s a core here) instead of re-hashing
with the digest function (SHA-256: about 1 GB/s). `buildvault verify` still re-hashes with the
digest function. A caller of `BlobStore.store_verified` computes it in the same pass as the
digest it names the bytes with, so what a store keeps is tied to the bytes the caller hashed.
"""

from __future__ import annotations

import xxhash

SIZE = 8  # bytes of a checksum (XXH3-64, big-endian)

new = xxhash.xxh3_64  # a streaming checksum: update(data), digest()


def of(data: bytes | bytearray | memoryview) -> bytes:
    """The checksum of `data` (releases the GIL: runs in worker threads beside the event loop)."""
    return xxhash.xxh3_64_digest(data)
