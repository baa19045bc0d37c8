"""Where bytes live. Knows nothing of gRPC or HTTP.

Two small async protocols, implemented by each tier and by wrappers that add one behaviour:

- `BlobStore`: the content-addressable store (CAS), keyed by `Digest.key`.
- `ActionStore`: serialized ActionResult messages (or other opaque entries), keyed by a
  namespace (the instance name plus a kind, see `ac_namespace`) and an action digest.

Contracts every implementation keeps:
- `write` verifies size and hash before the blob becomes visible and publishes atomically;
  a failed, cancelled or mismatching write leaves nothing visible.
- `read` is an `async def` that raises `NotFound` eagerly (before any byte is produced) and
  returns an async iterator of bounded chunks; memory does not grow with blob size.
- `lookup` finds a blob by its hash alone (the bazel-remote HTTP protocol's GET /cas/{hash}),
  from the store's own index: a blob stored before a restart, or by another front end, is found.
- Errors are the classes below; adapters map them to protocol status codes in one place.

Batches: `read_blobs(store, digests)` and `write_blobs(store, items)` below use a store's own
`read_blobs` / `write_blobs` when it has them (the disk store does the small ones in one trip to
its worker threads), and otherwise call `read` / `write` per blob, concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from buildvault.digest import Digest, DigestFunction, InvalidDigest

__all__ = [
    "ActionStore",
    "BlobStore",
    "CapacityExceeded",
    "DigestMismatch",
    "InvalidDigest",
    "InvalidRange",
    "NotFound",
    "StorageError",
    "StorageFull",
    "Unavailable",
    "ac_namespace",
    "read_blobs",
    "write_blobs",
    "CHUNK_SIZE",
]

# Chunk size for streaming reads: large enough to amortise syscalls and gRPC messages,
# small enough that a handful of concurrent streams stay within a few MiB.
CHUNK_SIZE = 1 << 20


class StorageError(Exception):
    """Base class of storage errors."""


class NotFound(StorageError):
    """The blob or entry is not stored (in this tier, or anywhere for a composed store)."""


class DigestMismatch(StorageError, ValueError):
    """The written bytes do not match the declared digest (size or hash). Nothing was stored."""


class CapacityExceeded(StorageError):
    """The blob is larger than the whole store may hold (RESOURCE_EXHAUSTED / HTTP 413)."""


class StorageFull(StorageError):
    """The device has no room for the write right now (RESOURCE_EXHAUSTED / HTTP 507)."""


class InvalidRange(StorageError, ValueError):
    """A read offset or limit outside the blob (OUT_OF_RANGE / HTTP 416)."""


class Unavailable(StorageError):
    """A tier needed to answer is down (UNAVAILABLE / HTTP 503)."""


@runtime_checkable
class BlobStore(Protocol):
    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        """The subset of `digests` not stored, in input order, without duplicates."""
        ...

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        """Raise NotFound now, or return an iterator over bytes [offset, offset+limit) (limit 0: to the end)."""
        ...

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        """Store the blob whose bytes `chunks` yields; raise DigestMismatch if they do not match."""
        ...

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        """The stored blob with this hash (its size from the store's own index), or raise NotFound."""
        ...


@runtime_checkable
class ActionStore(Protocol):
    async def get(self, namespace: str, digest: Digest) -> bytes:
        """The entry stored for (namespace, digest), or raise NotFound."""
        ...

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        """Store (replace) the entry atomically."""
        ...


def ac_namespace(instance_name: str, kind: str = "ac") -> str:
    """Namespace of action entries: the kind ("ac" for ActionResults, "raw" for opaque HTTP
    entries such as ccache's) and the instance name, kept apart so neither leaks into the other."""
    return f"{kind}/{instance_name}" if instance_name else kind


async def read_blobs(store: BlobStore, digests: Sequence[Digest]) -> list[bytes | Exception]:
    """Whole (small) blobs: for each digest its bytes, or the error reading it raised."""
    many = getattr(store, "read_blobs", None)
    if many is not None:
        return await many(digests)

    async def one(digest: Digest) -> bytes | Exception:
        try:
            chunks = await store.read(digest)
            parts = [chunk async for chunk in chunks]
            return parts[0] if len(parts) == 1 else b"".join(parts)
        except Exception as e:  # noqa: BLE001 - that blob's outcome
            return e

    return list(await asyncio.gather(*(one(d) for d in digests)))


async def write_blobs(store: BlobStore, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
    """Store whole (small) blobs: for each None, or the error writing it raised."""
    many = getattr(store, "write_blobs", None)
    if many is not None:
        return await many(items)

    async def one(digest: Digest, data: bytes) -> Exception | None:
        async def single() -> AsyncIterator[bytes]:
            yield data

        try:
            await store.write(digest, single())
            return None
        except Exception as e:  # noqa: BLE001 - that blob's outcome
            return e

    return list(await asyncio.gather(*(one(d, data) for d, data in items)))
