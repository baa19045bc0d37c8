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

Batch paths (`find_missing_indices`, `read_blobs`, `write_blobs`) are part of the protocol: a
request makes one store call whatever the stack. A store without a faster way implements them
with the `*_by_digests` / `*_one_by_one` helpers below; a decorator forwards them
(`ForwardingBlobStore`, below) unless it changes them.

`store_verified` is the one internal path: whole blobs whose caller hashed these exact bytes
itself, in this process, just before (the chunk store, for the chunks it cut and named), each with
the fast checksum (storage/fastsum.py) the caller computed over the same bytes in the same pass
(`Verified`). A store with a faster way (the disk store) skips re-hashing them, keeps every other
rule (the size check, atomic publish, capacity) and records the caller's checksum, which its
whole reads verify; every other store and decorator answers it with its verifying `write_blobs`
(`OneByOneBatches`, `ForwardingBlobStore`), so a decorator that does not know the path loses
nothing. Bytes other than those the caller hashed (a right-size wrong-bytes pair from a buggy
caller) are never served: they fail that checksum (tests/unit/test_store_contract.py holds each
store to that). No front end calls it: bytes from a client are always verified by `write` /
`write_blobs`.

The decorators every stack has live here too, one section each at the end: the forwarding bases
every decorator derives from, the empty blob (its one home) and the metering at the store
boundary (the one place bytes and action hits are counted, for gRPC and HTTP alike).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from buildvault.digest import Digest, DigestFunction, Hasher, InvalidDigest

__all__ = [
    "ActionStore",
    "BlobStore",
    "CapacityExceeded",
    "DigestMismatch",
    "EmptyBlobStore",
    "ForwardingActionStore",
    "ForwardingBlobStore",
    "InvalidDigest",
    "InvalidRange",
    "MeteredActionStore",
    "MeteredBlobStore",
    "OneByOneBatches",
    "NotFound",
    "StorageError",
    "StorageFull",
    "StoreRecorder",
    "Unavailable",
    "Verified",
    "ac_namespace",
    "as_pairs",
    "check_content",
    "close_chunks",
    "find_missing_indices_by_digests",
    "is_empty_blob",
    "read_blobs_one_by_one",
    "single_chunk",
    "write_blobs_one_by_one",
    "CHUNK_SIZE",
    "CLIENT_TIER",
    "REQUEST_PROTOCOL",
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


def check_content(digest: Digest, size: int, hasher: Hasher) -> None:
    """Raise DigestMismatch unless the `size` bytes fed to `hasher` are the blob `digest` names
    (the memory and object stores' writes, the disk store's whole small ones; a streamed disk or
    chunked write compares the hash its worker stages return)."""
    if size != digest.size_bytes:
        raise DigestMismatch(f"blob {digest}: got {size} bytes, declared {digest.size_bytes}")
    actual = hasher.hexdigest()
    if actual != digest.hash:
        raise DigestMismatch(f"blob {digest}: content hashes to {actual}")


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
    """The CAS. Every method a front end uses is here, batch paths included: a decorator that
    does not change a method forwards it (`ForwardingBlobStore`), so no fast path is lost under it."""

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        """The subset of `digests` not stored, in input order, without duplicates."""
        ...

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        """FindMissingBlobs without Digest objects: the indices i (ascending, each once even if the
        digest repeats) whose blob (hashes[i], sizes[i]) is not stored. Inputs are already validated."""
        ...

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        """Raise NotFound now, or return an iterator over bytes [offset, offset+limit) (limit 0: to the end)."""
        ...

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        """Whole (small) blobs, one call per batch: for each digest its bytes or the error reading it raised."""
        ...

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        """Store the blob whose bytes `chunks` yields; raise DigestMismatch if they do not match."""
        ...

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        """Store whole (small) blobs, one call per batch: for each None, or the error writing it raised."""
        ...

    async def store_verified(self, items: Sequence[Verified]) -> list[Exception | None]:
        """`write_blobs` for bytes the caller hashed itself, each with the fast checksum of the bytes
        it hashed (internal: see the module docstring); a store may skip re-hashing, never the size
        check or any other rule."""
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


async def find_missing_indices_by_digests(
    store: BlobStore, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
) -> list[int]:
    """`find_missing_indices` for a store whose natural question is `find_missing`."""
    digests = [Digest(h, s, function) for h, s in zip(hashes, sizes, strict=True)]
    absent = set(await store.find_missing(digests))
    seen: set[Digest] = set()
    out: list[int] = []
    for i, digest in enumerate(digests):
        if digest in absent and digest not in seen:
            out.append(i)
        seen.add(digest)
    return out


async def read_blobs_one_by_one(store: BlobStore, digests: Sequence[Digest]) -> list[bytes | Exception]:
    """`read_blobs` for a store with no batch path of its own: `read` per blob, concurrently."""

    async def one(digest: Digest) -> bytes | Exception:
        try:
            chunks = await store.read(digest)
            parts = [chunk async for chunk in chunks]
            return parts[0] if len(parts) == 1 else b"".join(parts)
        except Exception as e:  # that blob's outcome
            return e

    return list(await asyncio.gather(*(one(d) for d in digests)))


async def write_blobs_one_by_one(store: BlobStore, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
    """`write_blobs` for a store with no batch path of its own: `write` per blob, concurrently."""

    async def one(digest: Digest, data: bytes) -> Exception | None:
        try:
            await store.write(digest, single_chunk(data))
            return None
        except Exception as e:  # that blob's outcome
            return e

    return list(await asyncio.gather(*(one(d, data) for d, data in items)))


class OneByOneBatches:
    """Mixin for a store whose natural questions are per blob (memory, the bucket): the batch
    paths of the protocol, answered with the helpers above."""

    async def find_missing_indices(
        self: BlobStore, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        return await find_missing_indices_by_digests(self, function, hashes, sizes)

    async def read_blobs(self: BlobStore, digests: Sequence[Digest]) -> list[bytes | Exception]:
        return await read_blobs_one_by_one(self, digests)

    async def write_blobs(self: BlobStore, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        return await write_blobs_one_by_one(self, items)

    async def store_verified(self: BlobStore, items: Sequence[Verified]) -> list[Exception | None]:
        return await self.write_blobs(as_pairs(items))  # no faster way: verified like any write


# A blob for `store_verified`: its digest, its bytes, and the fast checksum (storage/fastsum.py)
# the caller computed over the bytes it hashed, in the same pass as the digest.
Verified = tuple[Digest, bytes, bytes]


def as_pairs(items: Sequence[Verified]) -> list[tuple[Digest, bytes]]:
    """`store_verified`'s items as `write_blobs` takes them (a store that verifies them anyway)."""
    return [(digest, data) for digest, data, _ in items]


async def single_chunk(data: bytes) -> AsyncIterator[bytes]:
    """An async iterator yielding `data` once (a whole small blob as a write stream)."""
    yield data


async def close_chunks(chunks: object) -> None:
    """Close a chunk stream now if it can be closed (an async generator, a disk read's FileChunks,
    a request body), releasing what it holds (a file, a bucket connection); errors while closing
    are not the caller's concern. Every front end and decorator closes streams through this."""
    close = getattr(chunks, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()


# -- Forwarding bases for store decorators -------------------------------------------------------
# Like a bb-storage BlobAccess decorator that embeds the interface it wraps, a decorator derives
# from `ForwardingBlobStore` / `ForwardingActionStore` and overrides only the methods whose
# behaviour it changes; every other method, batch paths included, reaches the inner store as it
# is. The one exception is `store_verified` (bytes the caller hashed itself): it goes through the
# decorator's own `write_blobs`, verified, unless the decorator forwards it on purpose, so a
# decorator that changes writes never has them bypass it. Nothing is found by probing for
# attributes, so no fast path is silently lost under a wrapper.


class ForwardingBlobStore:
    """A BlobStore that forwards every call to `inner`."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        return await self.inner.find_missing(digests)

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        return await self.inner.find_missing_indices(function, hashes, sizes)

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        return await self.inner.read(digest, offset, limit)

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        return await self.inner.read_blobs(digests)

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        await self.inner.write(digest, chunks)

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        return await self.inner.write_blobs(items)

    async def store_verified(self, items: Sequence[Verified]) -> list[Exception | None]:
        return await self.write_blobs(as_pairs(items))  # see the module docstring: verified unless overridden

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        return await self.inner.lookup(function, hash)


class ForwardingActionStore:
    """An ActionStore that forwards every call to `inner`."""

    def __init__(self, inner: ActionStore) -> None:
        self.inner = inner

    async def get(self, namespace: str, digest: Digest) -> bytes:
        return await self.inner.get(namespace, digest)

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        await self.inner.put(namespace, digest, data)


# -- The empty blob: always present and readable, stored or not ----------------------------------
# Why a decorator: the REAPI lets clients assume the empty blob exists without uploading it
# (Bazel never uploads it). Every answer about it (FindMissingBlobs, reads, batch reads, lookups by
# hash) is given here, once, instead of by each front end; a write of it stores nothing. Like
# bb-storage's EmptyBlobInjectingBlobAccess. Calls that involve no empty blob reach the inner
# store unchanged: the batch paths check `0 in sizes` first, so a batch without one costs nothing.


EMPTY_HASHES: dict[DigestFunction, str] = {function: Digest.of(b"", function).hash for function in DigestFunction}


def is_empty_blob(digest: Digest) -> bool:
    """True for the empty blob of the digest's function (size 0 and the hash of no bytes)."""
    return digest.size_bytes == 0 and digest.hash == EMPTY_HASHES[digest.function]


async def _no_chunks() -> AsyncIterator[bytes]:
    return
    yield  # pragma: no cover - makes this an async generator


class EmptyBlobStore(ForwardingBlobStore):
    """A BlobStore on which the empty blob is always present; everything else is forwarded."""

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        if not any(d.size_bytes == 0 for d in digests):
            return await self.inner.find_missing(digests)
        return await self.inner.find_missing([d for d in digests if not is_empty_blob(d)])

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        absent = await self.inner.find_missing_indices(function, hashes, sizes)
        if absent and 0 in sizes:
            empty = EMPTY_HASHES[function]
            absent = [i for i in absent if sizes[i] != 0 or hashes[i] != empty]
        return absent

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        if not is_empty_blob(digest):
            return await self.inner.read(digest, offset, limit)
        if offset != 0 or limit < 0:
            raise InvalidRange(f"read offset {offset}/limit {limit} out of range for the empty blob")
        return _no_chunks()

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        if not any(d.size_bytes == 0 for d in digests):
            return await self.inner.read_blobs(digests)
        stored = [i for i, d in enumerate(digests) if not is_empty_blob(d)]
        results: list[bytes | Exception] = [b""] * len(digests)
        if stored:
            for i, result in zip(stored, await self.inner.read_blobs([digests[i] for i in stored]), strict=True):
                results[i] = result
        return results

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        if not is_empty_blob(digest):
            await self.inner.write(digest, chunks)
            return
        async for chunk in chunks:
            if chunk:
                raise DigestMismatch(f"blob {digest}: declared empty, got bytes")

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        if not any(d.size_bytes == 0 for d, _ in items):
            return await self.inner.write_blobs(items)
        outcomes: list[Exception | None] = [None] * len(items)
        stored = [i for i, (d, _) in enumerate(items) if not is_empty_blob(d)]
        for i, (d, data) in enumerate(items):
            if is_empty_blob(d) and data:
                outcomes[i] = DigestMismatch(f"blob {d}: declared empty, got {len(data)} bytes")
        if stored:
            for i, outcome in zip(stored, await self.inner.write_blobs([items[i] for i in stored]), strict=True):
                outcomes[i] = outcome
        return outcomes

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        if hash == EMPTY_HASHES[function]:
            return Digest(hash, 0, function)
        return await self.inner.lookup(function, hash)


# -- Per-tier metrics, counted at the store boundary ---------------------------------------------
# Why a decorator: bytes read and written and action-entry hits are facts about a store, so they
# are counted where a store is called, once per tier (the builder wraps every tier), instead of by
# parsing protocol messages in a front end. storage/ defines no metric: it reports to a
# `StoreRecorder` (server/metrics.py's `Metrics` is one), which owns the names.
#
# The front end of a request may set `REQUEST_PROTOCOL` (e.g. "grpc") for the request's duration;
# the recorder receives it with every count, so the outermost tier can carry the protocol label.
# Batch calls are counted as one call; the per-blob work is a sum over the results.


# The tier that clients see (the whole stack); build.py names the others.
CLIENT_TIER = "client"

REQUEST_PROTOCOL: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "buildvault_request_protocol", default=None
)


class StoreRecorder(Protocol):
    """Where a metered store reports. `tier` is the builder's name for the store ("client",
    "local", "object_store"); `protocol` is REQUEST_PROTOCOL at the time of the call."""

    def store_call(self, tier: str, operation: str) -> None: ...

    def store_read(self, tier: str, protocol: str | None, nbytes: int) -> None: ...

    def store_written(self, tier: str, protocol: str | None, nbytes: int) -> None: ...

    def store_action_lookup(self, tier: str, protocol: str | None, hit: bool) -> None: ...


class MeteredBlobStore(ForwardingBlobStore):
    """Counts calls by operation and the blob bytes that cross this boundary."""

    def __init__(self, inner: BlobStore, recorder: StoreRecorder, tier: str) -> None:
        super().__init__(inner)
        self.recorder = recorder
        self.tier = tier

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        self.recorder.store_call(self.tier, "find_missing")
        return await self.inner.find_missing(digests)

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        self.recorder.store_call(self.tier, "find_missing")
        return await self.inner.find_missing_indices(function, hashes, sizes)

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        self.recorder.store_call(self.tier, "read")
        chunks = await self.inner.read(digest, offset, limit)
        return self._counted(chunks, REQUEST_PROTOCOL.get())

    async def _counted(self, chunks: AsyncIterator[bytes], protocol: str | None) -> AsyncIterator[bytes]:
        total = 0
        try:
            async for chunk in chunks:
                total += len(chunk)
                yield chunk
        finally:
            await close_chunks(chunks)
            if total:
                self.recorder.store_read(self.tier, protocol, total)

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        self.recorder.store_call(self.tier, "read_blobs")
        results = await self.inner.read_blobs(digests)
        total = sum(len(r) for r in results if isinstance(r, bytes))
        if total:
            self.recorder.store_read(self.tier, REQUEST_PROTOCOL.get(), total)
        return results

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        self.recorder.store_call(self.tier, "write")
        await self.inner.write(digest, chunks)
        if digest.size_bytes:
            self.recorder.store_written(self.tier, REQUEST_PROTOCOL.get(), digest.size_bytes)

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        self.recorder.store_call(self.tier, "write_blobs")
        return self._written(items, await self.inner.write_blobs(items))

    async def store_verified(self, items: Sequence[Verified]) -> list[Exception | None]:
        # Forwarded on purpose (metering changes no bytes): the local tier's fast path stays.
        self.recorder.store_call(self.tier, "write_blobs")
        return self._written(as_pairs(items), await self.inner.store_verified(items))

    def _written(
        self, items: Sequence[tuple[Digest, bytes]], outcomes: list[Exception | None]
    ) -> list[Exception | None]:
        total = sum(len(data) for (_, data), outcome in zip(items, outcomes, strict=True) if outcome is None)
        if total:
            self.recorder.store_written(self.tier, REQUEST_PROTOCOL.get(), total)
        return outcomes

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        self.recorder.store_call(self.tier, "lookup")
        return await self.inner.lookup(function, hash)


class MeteredActionStore(ForwardingActionStore):
    """Counts calls and action-entry lookups that found / did not find an entry."""

    def __init__(self, inner: ActionStore, recorder: StoreRecorder, tier: str) -> None:
        super().__init__(inner)
        self.recorder = recorder
        self.tier = tier

    async def get(self, namespace: str, digest: Digest) -> bytes:
        self.recorder.store_call(self.tier, "get")
        try:
            data = await self.inner.get(namespace, digest)
        except NotFound:
            self.recorder.store_action_lookup(self.tier, REQUEST_PROTOCOL.get(), False)
            raise
        self.recorder.store_action_lookup(self.tier, REQUEST_PROTOCOL.get(), True)
        return data

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        self.recorder.store_call(self.tier, "put")
        await self.inner.put(namespace, digest, data)
