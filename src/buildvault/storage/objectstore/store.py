"""The S3/OBS object-store tier: a `BlobStore` and `ActionStore` on one bucket.

Key layout inside the bucket (``prefix`` is normalised to end with ``/`` when non-empty):

    {prefix}cas/{fn}/{hash}                  CAS blob: the raw bytes, nothing else
    {prefix}ac/{namespace}/{fn}/{hash}       action entry (serialized ActionResult or a raw
                                             entry); `namespace` is `ac_namespace(...)`, e.g.
                                             "ac", "ac/my-instance", "raw/my-instance"

``fn`` is the digest function label (``sha256``, ``blake3``). The last two path segments of a
key are always ``{fn}/{hash}`` (hash: 64 hex digits), so keys parse unambiguously from the
right whatever the namespace holds. CAS objects carry no metadata: the key *is* the checksum
and every whole-blob read re-hashes the bytes. Action entries carry ``x-amz-meta-bv-sha256``
(SHA-256 of the body), checked on every get when present. Several buildvault servers (and
several digest functions) share one bucket safely; writes are idempotent overwrites.

Every boto3 call runs in this store's thread pool (client.py), never on the event loop. The pool's threads
are daemon threads: a call stuck on a hung bucket (botocore waits `read_timeout` per attempt)
never holds up process exit after `close()`; its journal entry is simply still pending. Requests are
counted by operation in `request_counts` (API calls, not HTTP retries). Objects that fail
verification are never served: a wrong size raises `CorruptObject` before any byte, a wrong
hash raises it before the last chunk is yielded, and both are counted in `corrupt_objects`.
`CorruptObject` is a `NotFound`: a client treats the blob as absent and uploads it again,
which overwrites (repairs) the object.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import boto3

from buildvault.digest import Digest, DigestFunction, InvalidDigest, new_hasher
from buildvault.storage import (
    CHUNK_SIZE,
    DigestMismatch,
    InvalidRange,
    NotFound,
    OneByOneBatches,
    StorageError,
    Unavailable,
    check_content,
)
from buildvault.storage.objectstore.client import DaemonThreadPool, make_s3_client
from buildvault.storage.objectstore.errors import map_error

if TYPE_CHECKING:
    from buildvault.config import Settings

logger = logging.getLogger(__name__)

MiB = 1 << 20
S3_MIN_PART_SIZE = 5 * MiB  # S3 rejects smaller non-final parts
S3_MAX_PARTS = 10_000
DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_MULTIPART_THRESHOLD = 64 * MiB
# Single PUTs up to this size are buffered in memory; larger ones spool to a temporary file.
IN_MEMORY_PUT_LIMIT = 8 * MiB
MAX_ACTION_ENTRY_SIZE = 64 * MiB

REQUEST_KINDS = (
    "HEAD",
    "GET",
    "PUT",
    "LIST",
    "DELETE",
    "COPY",
    "HEAD_BUCKET",
    "MULTIPART_CREATE",
    "MULTIPART_PART",
    "MULTIPART_COMPLETE",
    "MULTIPART_ABORT",
)


class CorruptObject(NotFound):
    """The bucket holds an object under the blob's key whose bytes do not match the digest.

    A `NotFound`: the blob is treated as absent, so the client uploads it again and the upload
    overwrites the bad object. Never served."""


def normalize_prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/" if prefix else ""


class ObjectStore(OneByOneBatches):
    """BlobStore + ActionStore on an S3-compatible bucket (see the module docstring for keys)."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str = "",
        *,
        max_workers: int = 32,
        part_size: int = DEFAULT_PART_SIZE,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        read_only: bool = False,
        head_concurrency: int = 32,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not bucket:
            raise ValueError("ObjectStore needs a bucket name")
        self._client = client
        self.bucket = bucket
        self.prefix = normalize_prefix(prefix)
        self.part_size = max(S3_MIN_PART_SIZE, part_size)
        self.multipart_threshold = max(self.part_size, multipart_threshold)
        self.read_only = read_only
        self._executor = DaemonThreadPool(max_workers, thread_name_prefix="buildvault-s3")
        self._head_concurrency = max(1, head_concurrency)
        self._spool_dir = spool_dir
        self.request_counts: dict[str, int] = dict.fromkeys(REQUEST_KINDS, 0)
        self.corrupt_objects = 0
        self.bytes_read = 0
        self.bytes_written = 0

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        max_workers: int = 32,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        max_attempts: int = 3,
        session: boto3.session.Session | None = None,
        **kwargs: Any,
    ) -> ObjectStore:
        client = make_s3_client(
            settings,
            max_pool_connections=max_workers,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_attempts=max_attempts,
            session=session,
        )
        kwargs.setdefault("read_only", settings.s3_read_only)
        return cls(client, settings.s3_bucket, settings.s3_prefix, max_workers=max_workers, **kwargs)

    @property
    def client(self) -> Any:
        return self._client

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):  # best effort
            self._client.close()

    # -- keys ---------------------------------------------------------------------------

    def cas_key(self, digest: Digest) -> str:
        return f"{self.prefix}cas/{digest.function.label}/{digest.hash}"

    def ac_key(self, namespace: str, digest: Digest) -> str:
        return f"{self.prefix}ac/{namespace}/{digest.function.label}/{digest.hash}"

    # -- plumbing -----------------------------------------------------------------------

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def _call(self, kind: str, what: str, method: Callable[..., Any], **params: Any) -> Any:
        """One API call (`method` of the boto3 client) on this bucket, counted by `kind`, errors mapped."""
        self.request_counts[kind] = self.request_counts.get(kind, 0) + 1
        try:
            return await self._run(method, Bucket=self.bucket, **params)
        except Exception as exc:
            raise map_error(exc, what) from exc

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise StorageError(f"{what}: the object store is read-only on this server")

    def _corrupt(self, message: str) -> CorruptObject:
        self.corrupt_objects += 1
        logger.error("corrupt object in bucket %s: %s", self.bucket, message)
        return CorruptObject(message)

    # -- health -------------------------------------------------------------------------

    async def probe(self) -> None:
        """One cheap request proving the bucket is reachable (HEAD bucket); raises Unavailable."""
        await self._call("HEAD_BUCKET", f"bucket {self.bucket}", self._client.head_bucket)

    # -- BlobStore ----------------------------------------------------------------------

    async def exists(self, digest: Digest) -> bool:
        """HEAD the blob: True iff an object of the right size is stored under its key."""
        try:
            head = await self._call("HEAD", f"blob {digest}", self._client.head_object, Key=self.cas_key(digest))
        except NotFound:
            return False
        size = head.get("ContentLength")
        if size is not None and size != digest.size_bytes:
            self._corrupt(f"blob {digest}: object has {size} bytes")
            return False
        return True

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        """HEAD the blob's key (keys carry no size): the object's size is the blob's."""
        try:
            probe = Digest.parse(hash, 0, function)
        except InvalidDigest:
            raise NotFound(f"blob {function.label}:{str(hash)[:64]} not found") from None
        what = f"blob {function.label}:{hash}"
        head = await self._call("HEAD", what, self._client.head_object, Key=self.cas_key(probe))
        size = head.get("ContentLength")
        if not isinstance(size, int) or size < 0:
            raise NotFound(f"blob {function.label}:{hash}: the object store did not say its size")
        return Digest(hash, size, function)

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        unique = list(dict.fromkeys(digests))
        semaphore = asyncio.Semaphore(self._head_concurrency)

        async def check(digest: Digest) -> bool:
            async with semaphore:
                return await self.exists(digest)

        present = await asyncio.gather(*(check(d) for d in unique))
        return [d for d, here in zip(unique, present, strict=True) if not here]

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        size = digest.size_bytes
        if offset < 0 or limit < 0 or offset > size:
            raise InvalidRange(f"read offset {offset}/limit {limit} out of range for blob {digest}")
        end = size if limit == 0 else min(size, offset + limit)
        key = self.cas_key(digest)
        what = f"blob {digest}"
        if offset == 0 and end == size:
            response = await self._call("GET", what, self._client.get_object, Key=key)
            body = response["Body"]
            length = response.get("ContentLength")
            if length is not None and length != size:
                await self._run(body.close)
                raise self._corrupt(f"{what}: object has {length} bytes")
            return self._verified_chunks(digest, body)
        if offset == end:
            # An empty range: S3 would answer 416 for "bytes=size-", so prove existence instead.
            if not await self.exists(digest):
                raise NotFound(f"{what}: not in the bucket")
            return _empty()
        response = await self._call("GET", what, self._client.get_object, Key=key, Range=f"bytes={offset}-{end - 1}")
        body = response["Body"]
        total = _content_range_total(response.get("ContentRange"))
        length = response.get("ContentLength")
        if (total is not None and total != size) or (length is not None and length != end - offset):
            await self._run(body.close)
            raise self._corrupt(f"{what}: object has {total} bytes (range length {length})")
        return self._ranged_chunks(digest, body, end - offset)

    def _read_chunk(self, body: Any, hasher: Any) -> bytes:
        chunk: bytes = body.read(CHUNK_SIZE)
        if hasher is not None and chunk:
            hasher.update(chunk)
        return chunk

    async def _verified_chunks(self, digest: Digest, body: Any) -> AsyncIterator[bytes]:
        """Yield the whole blob, holding back the last chunk until size and hash are verified."""
        hasher = new_hasher(digest.function)
        pending: bytes | None = None
        total = 0
        what = f"blob {digest}"
        try:
            while True:
                try:
                    chunk = await self._run(self._read_chunk, body, hasher)
                except Exception as exc:
                    raise map_error(exc, what) from exc
                if not chunk:
                    break
                total += len(chunk)
                if total > digest.size_bytes:
                    raise self._corrupt(f"{what}: object is longer than {digest.size_bytes} bytes")
                if pending is not None:
                    yield pending
                pending = chunk
            if total != digest.size_bytes:
                raise self._corrupt(f"{what}: object has {total} bytes")
            actual = hasher.hexdigest()
            if actual != digest.hash:
                raise self._corrupt(f"{what}: object content hashes to {actual}")
            self.bytes_read += total
            if pending is not None:
                yield pending
        finally:
            await asyncio.shield(self._close_body(body))

    async def _ranged_chunks(self, digest: Digest, body: Any, length: int) -> AsyncIterator[bytes]:
        """A range cannot be hashed; its length is checked (the object size was checked)."""
        total = 0
        what = f"blob {digest}"
        try:
            while total < length:
                try:
                    chunk = await self._run(self._read_chunk, body, None)
                except Exception as exc:
                    raise map_error(exc, what) from exc
                if not chunk:
                    raise Unavailable(f"{what}: object store closed the stream after {total} of {length} bytes")
                if total + len(chunk) > length:
                    chunk = chunk[: length - total]
                total += len(chunk)
                self.bytes_read += len(chunk)
                yield chunk
        finally:
            await asyncio.shield(self._close_body(body))

    async def _close_body(self, body: Any) -> None:
        with contextlib.suppress(Exception):  # best effort
            await self._run(body.close)

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        """Verify while uploading; the object becomes visible only if the bytes match."""
        self._check_writable(f"blob {digest}")
        if digest.size_bytes > self.multipart_threshold:
            await self._write_multipart(digest, chunks)
        else:
            await self._write_single(digest, chunks)
        self.bytes_written += digest.size_bytes

    async def _write_single(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        what = f"blob {digest}"
        hasher = new_hasher(digest.function)
        spool: Any = None
        parts: list[bytes] = []
        size = 0
        try:
            if digest.size_bytes > IN_MEMORY_PUT_LIMIT:
                spool = await self._run(tempfile.TemporaryFile, dir=self._spool_dir)
            async for chunk in chunks:
                size += len(chunk)
                if size > digest.size_bytes:
                    raise DigestMismatch(f"{what}: more than the declared {digest.size_bytes} bytes")
                if spool is not None:
                    await self._run(_hash_and_write, hasher, spool, chunk)
                else:
                    hasher.update(chunk)
                    parts.append(chunk)
            check_content(digest, size, hasher)
            if spool is not None:
                await self._run(spool.seek, 0)
                body: Any = spool
            else:
                body = b"".join(parts)
                parts.clear()
            await self._call(
                "PUT",
                what,
                self._client.put_object,
                Key=self.cas_key(digest),
                Body=body,
                ContentLength=digest.size_bytes,
                ContentType="application/octet-stream",
            )
        finally:
            if spool is not None:
                await asyncio.shield(self._run(spool.close))

    async def _write_multipart(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        what = f"blob {digest}"
        key = self.cas_key(digest)
        part_size = max(self.part_size, -(-digest.size_bytes // S3_MAX_PARTS))
        created = await self._call(
            "MULTIPART_CREATE",
            what,
            self._client.create_multipart_upload,
            Key=key,
            ContentType="application/octet-stream",
        )
        upload_id = created["UploadId"]
        hasher = new_hasher(digest.function)
        parts: list[dict[str, Any]] = []
        buffer = bytearray()
        size = 0

        async def flush(data: bytes) -> None:
            number = len(parts) + 1
            result = await self._call(
                "MULTIPART_PART", what, self._client.upload_part, Key=key, UploadId=upload_id, PartNumber=number,
                Body=data,
            )  # fmt: skip
            parts.append({"ETag": result["ETag"], "PartNumber": number})

        completed = False
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > digest.size_bytes:
                    raise DigestMismatch(f"{what}: more than the declared {digest.size_bytes} bytes")
                await self._run(hasher.update, chunk)
                buffer += chunk
                while len(buffer) >= part_size:
                    data = bytes(buffer[:part_size])
                    del buffer[:part_size]
                    await flush(data)
            check_content(digest, size, hasher)
            if buffer or not parts:
                await flush(bytes(buffer))
                buffer.clear()
            await self._call(
                "MULTIPART_COMPLETE",
                what,
                self._client.complete_multipart_upload,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
            completed = True
        finally:
            if not completed:
                # Nothing becomes visible. (Configure an AbortIncompleteMultipartUpload lifecycle
                # rule on the bucket as well, for servers killed mid-upload.)
                await asyncio.shield(self._abort_multipart(key, upload_id, what))

    async def _abort_multipart(self, key: str, upload_id: str, what: str) -> None:
        try:
            await self._call("MULTIPART_ABORT", what, self._client.abort_multipart_upload, Key=key, UploadId=upload_id)
        except StorageError as exc:
            logger.warning("%s: could not abort multipart upload %s: %s", what, upload_id, exc)

    # -- ActionStore --------------------------------------------------------------------

    async def get(self, namespace: str, digest: Digest) -> bytes:
        what = f"entry {digest} in {namespace!r}"
        response = await self._call("GET", what, self._client.get_object, Key=self.ac_key(namespace, digest))
        body = response["Body"]
        try:
            length = response.get("ContentLength") or 0
            if length > MAX_ACTION_ENTRY_SIZE:
                raise self._corrupt(f"{what}: {length} bytes, more than any action entry")
            try:
                data: bytes = await self._run(body.read)
            except Exception as exc:
                raise map_error(exc, what) from exc
        finally:
            await asyncio.shield(self._close_body(body))
        expected = (response.get("Metadata") or {}).get("bv-sha256")
        if expected is not None and hashlib.sha256(data).hexdigest() != expected:
            raise self._corrupt(f"{what}: body does not match its bv-sha256 checksum")
        self.bytes_read += len(data)
        return data

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        what = f"entry {digest} in {namespace!r}"
        self._check_writable(what)
        data = bytes(data)
        await self._call(
            "PUT",
            what,
            self._client.put_object,
            Key=self.ac_key(namespace, digest),
            Body=data,
            ContentLength=len(data),
            ContentType="application/octet-stream",
            Metadata={"bv-sha256": hashlib.sha256(data).hexdigest()},
        )
        self.bytes_written += len(data)

    async def refresh_entry(self, namespace: str, digest: Digest) -> bool:
        """Renew an entry's LastModified (what `buildvault gc` reads as its last use): copy it onto
        itself, metadata kept. False if it is not in the bucket: an entry is never recreated here.
        The copy is conditional on the ETag just seen, so a concurrent rewrite is never clobbered."""
        what = f"entry {digest} in {namespace!r}"
        self._check_writable(what)
        key = self.ac_key(namespace, digest)
        try:
            head = await self._call("HEAD", what, self._client.head_object, Key=key)
        except NotFound:
            return False
        await self._call(
            "COPY",
            what,
            self._client.copy_object,
            Key=key,
            CopySource={"Bucket": self.bucket, "Key": key},
            CopySourceIfMatch=head["ETag"],
            MetadataDirective="REPLACE",
            Metadata=head.get("Metadata") or {},
            ContentType=head.get("ContentType") or "application/octet-stream",
        )
        return True


def _hash_and_write(hasher: Any, spool: Any, chunk: bytes) -> None:
    hasher.update(chunk)
    spool.write(chunk)


def _content_range_total(value: str | None) -> int | None:
    # "bytes 0-99/1234"
    if not value or "/" not in value:
        return None
    total = value.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None


async def _empty() -> AsyncIterator[bytes]:
    return
    yield  # pragma: no cover
