"""google.bytestream.ByteStream over the CAS: streaming Read, resumable Write, QueryWriteStatus.

Writes stream straight into `BlobStore.write`: the store's write task pulls requests from the
Write stream itself, so memory does not grow with the blob and no message costs a task switch
(the gRPC flow control is the backpressure). Each upload is an `Upload` keyed by its resource name
(`{instance}/uploads/{uuid}/...`): if the Write stream breaks before `finish_write`, the
upload stays alive for a grace period, QueryWriteStatus reports how much was committed, and
a new Write whose `write_offset` equals that continues the same pending store write. An
upload that is not continued in time is cancelled, and a cancelled store write publishes
nothing.

Offsets of `compressed-blobs/zstd/...` uploads count compressed bytes (what the spec and
Bazel use after the first request); the uncompressed digest is what the store verifies.
A Write for a blob that is already stored completes at once with committed_size equal to
the blob size (uncompressed) or -1 (compressed), as the spec says.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import traceback
from collections.abc import AsyncIterator
from typing import Any

import grpc

from buildvault import logs
from buildvault.compression import zstd_compress_stream, zstd_decompress_stream
from buildvault.digest import ResourceName, parse_read_resource, parse_write_resource
from buildvault.remote_apis import bs_pb2
from buildvault.server import errors
from buildvault.server.grpc import READ_CHUNK_SIZE, Context, rpc
from buildvault.storage import BlobStore, InvalidRange, StorageError, close_chunks

SERVICE = "google.bytestream.ByteStream"

log = logging.getLogger("buildvault.bytestream")

# How long a Write stream that broke before finish_write stays resumable.
DEFAULT_UPLOAD_GRACE = 60.0
# Finished uploads remembered for QueryWriteStatus.
COMPLETED_MEMORY = 10_000
# Uploads kept resumable without a stream at most: each holds up to ~2 MiB of received bytes in
# the store's writer until it is resumed or its grace ends, so clients abandoning uploads in a
# loop would otherwise grow memory without bound. Beyond it the oldest is aborted (its client
# starts it again, as after the grace).
MAX_DETACHED = 32

# Outcomes of one Write stream feeding an upload.
FINISHED = "finished"  # finish_write seen: the store is verifying and publishing
CLOSED = "closed"  # the stream ended without finish_write: resumable
STORED = "stored"  # the store already had the blob


class UploadAborted(StorageError):
    """The upload was abandoned (no resumption within the grace period, or shutdown)."""


# An upload's identity: instance, upload id, compressor, storage key and size.
UploadKey = tuple[str, str | None, str | None, str, int]


def _upload_key(resource: ResourceName) -> UploadKey:
    digest = resource.digest
    return (resource.instance_name, resource.upload_id, resource.compressor, digest.key, digest.size_bytes)


def _settle(future: asyncio.Future[object] | None, result: object = None, error: BaseException | None = None) -> None:
    if future is not None and not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _clear_cancelled_frames(task: asyncio.Task[None]) -> None:
    """Clear the locals of the frames a cancelled task's CancelledError passed through.

    The task keeps that error, whose traceback keeps those frames: `Upload._source` or the store
    writer holding it, and through them the upload, which keeps the task. Only the cyclic GC frees
    such a loop, with the chunks the writer held, and a server that goes quiet after a burst of
    abandoned uploads may not run it for minutes (bench/RESULTS.md, "Abandoned uploads left
    reference cycles"). Only the cancelled case: those frames are the finished task's own. A
    refused upload's error is also raised in its Write handler, whose frames must not be cleared;
    that rarer loop is left to the cyclic GC."""
    try:
        task.exception()
    except asyncio.CancelledError as cancelled:  # not kept past the block: it would hold this frame
        traceback.clear_frames(cancelled.__traceback__)


class Upload:
    """One resumable upload: a pending `store.write` whose bytes come from Write streams.

    The store's write task pulls requests straight from the attached stream (no queue, no
    task switch per message) and checks each one's offset. The Write handler only waits for
    the stream's outcome. When a stream ends without finish_write (closed or broken), the
    source waits for the next stream to attach; `abort()` cancels the store write instead.
    """

    def __init__(self, manager: Uploads, key: UploadKey, resource: ResourceName, name: str) -> None:
        self.manager = manager
        self.key = key
        self.resource = resource
        self.name = name
        self.digest = resource.digest
        self.committed = 0  # bytes accepted, as the client counts them (compressed for zstd)
        self.attached = False  # a Write handler is waiting on this upload
        self.finishing = False
        self.early = False  # the store had the blob before this upload sent everything
        # The attached stream and its first request, until the source takes them.
        self._attached: tuple[bs_pb2.WriteRequest, AsyncIterator[bs_pb2.WriteRequest]] | None = None
        self._outcome: asyncio.Future[object] | None = None
        self._waiter: asyncio.Future[object] | None = None
        self._expiry: asyncio.TimerHandle | None = None
        source: AsyncIterator[bytes] = self._source()
        if resource.compressor == "zstd":
            source = zstd_decompress_stream(source, self.digest.size_bytes)
        self.task = asyncio.create_task(manager.blobs.write(self.digest, source), name=f"upload {self.digest}")
        self.task.add_done_callback(self._done)

    async def _source(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        while True:
            while self._attached is None:
                self._waiter = loop.create_future()
                await self._waiter
            request, iterator = self._attached
            self._attached = None
            outcome = self._outcome
            try:
                while True:
                    if request.resource_name and request.resource_name != self.name:
                        raise errors.InvalidArgument("resource_name changed within one Write stream")
                    if request.write_offset != self.committed:
                        raise errors.InvalidArgument(
                            f"write_offset {request.write_offset} does not match the committed size {self.committed}"
                        )
                    data = request.data  # a copy: drop the request so the chunk is not held twice
                    finish = request.finish_write
                    del request
                    if data:
                        self.committed += len(data)
                        yield data
                    if finish:
                        self.finishing = True
                        _settle(outcome, FINISHED)
                        return
                    try:
                        request = await iterator.__anext__()
                    except StopAsyncIteration:
                        raise
                    except Exception as e:  # a broken transport, not bad data
                        log.debug("Write stream for %s broke: %r", self.digest, e)
                        raise StopAsyncIteration from None
            except StopAsyncIteration:
                # Closed without finish_write, or broken (a vanished client looks the same here).
                _settle(outcome, CLOSED)
            except errors.RequestError as e:
                _settle(outcome, error=e)
                raise

    def _done(self, task: asyncio.Task[None]) -> None:
        self._cancel_expiry()
        self.manager._forget(self)
        if task.cancelled():
            _clear_cancelled_frames(task)
            _settle(self._outcome, error=UploadAborted(f"upload of {self.digest} was abandoned"))
            return
        error = task.exception()
        if error is not None:
            _settle(self._outcome, error=error)
            return
        if not self.finishing:
            self.early = True
        _settle(self._outcome, STORED)
        self.manager._remember(self.key, self.response_size())

    def response_size(self) -> int:
        """committed_size to report once the blob is stored."""
        if not self.early:
            return self.committed
        return -1 if self.resource.compressor is not None else self.digest.size_bytes

    def attach(
        self, first: bs_pb2.WriteRequest, iterator: AsyncIterator[bs_pb2.WriteRequest]
    ) -> asyncio.Future[object]:
        """Feed the upload from this stream; the future says how the stream ended."""
        self._cancel_expiry()
        self.manager._resumable.pop(self.key, None)
        self.attached = True
        self._outcome = asyncio.get_running_loop().create_future()
        self._attached = (first, iterator)
        _settle(self._waiter)
        return self._outcome

    async def wait_stored(self) -> None:
        """After FINISHED: wait until the store verified and published the blob (or refused it)."""
        try:
            # A client that disconnects now does not undo its upload.
            await asyncio.shield(self.task)
        except asyncio.CancelledError:
            if self.task.cancelled():
                raise UploadAborted(f"upload of {self.digest} was abandoned") from None
            raise

    def detach(self) -> None:
        """The feeding stream went away: stay resumable for the grace period."""
        self.attached = False
        if self.task.done() or self.finishing:
            return
        self._cancel_expiry()
        self._expiry = asyncio.get_running_loop().call_later(self.manager.grace, self.abort)
        self.manager._detached(self)

    def abort(self) -> None:
        """Abandon the upload: the store write is cancelled and nothing becomes visible."""
        self._cancel_expiry()
        if not self.task.done():
            self.task.cancel()
        self.manager._forget(self)

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None


class Uploads:
    """The uploads in progress, by resource name, and the recently finished ones."""

    def __init__(
        self, blobs: BlobStore, grace: float = DEFAULT_UPLOAD_GRACE, max_detached: int = MAX_DETACHED
    ) -> None:
        self.blobs = blobs
        self.grace = grace
        self.max_detached = max_detached
        self._active: dict[UploadKey, Upload] = {}
        # Detached uploads waiting for a stream, oldest first.
        self._resumable: collections.OrderedDict[UploadKey, Upload] = collections.OrderedDict()
        self._completed: collections.OrderedDict[UploadKey, int] = collections.OrderedDict()

    def get(self, key: UploadKey) -> Upload | None:
        return self._active.get(key)

    def start(self, key: UploadKey, resource: ResourceName, name: str) -> Upload:
        upload = Upload(self, key, resource, name)
        self._active[key] = upload
        self._completed.pop(key, None)
        return upload

    def completed(self, key: UploadKey) -> int | None:
        return self._completed.get(key)

    def _forget(self, upload: Upload) -> None:
        if self._active.get(upload.key) is upload:
            del self._active[upload.key]
        if self._resumable.get(upload.key) is upload:
            del self._resumable[upload.key]

    def _detached(self, upload: Upload) -> None:
        """`upload` waits for a stream to resume it; past `max_detached` the oldest waiting is aborted."""
        self._resumable[upload.key] = upload
        self._resumable.move_to_end(upload.key)
        while len(self._resumable) > self.max_detached:
            _, oldest = self._resumable.popitem(last=False)
            log.info("upload of %s aborted: more than %d uploads wait to be resumed", oldest.digest, self.max_detached)
            oldest.abort()

    @property
    def detached(self) -> int:
        """Uploads waiting to be resumed (for tests and the status page)."""
        return len(self._resumable)

    def _remember(self, key: UploadKey, committed: int) -> None:
        self._completed[key] = committed
        self._completed.move_to_end(key)
        while len(self._completed) > COMPLETED_MEMORY:
            self._completed.popitem(last=False)

    def __len__(self) -> int:
        return len(self._active)

    async def close(self) -> None:
        """Abort every unfinished upload and wait for the store writes to unwind."""
        uploads = list(self._active.values())
        for upload in uploads:
            if not upload.finishing:
                upload.abort()
        if uploads:
            await asyncio.gather(*(u.task for u in uploads), return_exceptions=True)


class ByteStreamService:
    """google.bytestream.ByteStream for blobs: Read, Write, QueryWriteStatus."""

    def __init__(self, blobs: BlobStore, uploads: Uploads | None = None) -> None:
        self.blobs = blobs
        self.uploads = uploads if uploads is not None else Uploads(blobs)

    async def _exists(self, resource: ResourceName) -> bool:
        return not await self.blobs.find_missing([resource.digest])  # the empty blob: storage.EmptyBlobStore

    @rpc("Read")
    async def Read(self, request: bs_pb2.ReadRequest, context: Context) -> None:
        resource = parse_read_resource(request.resource_name)
        digest = resource.digest
        offset, limit = request.read_offset, request.read_limit
        if offset < 0:
            raise errors.OutOfRange(f"read_offset {offset} is negative")
        if limit < 0:
            raise errors.InvalidArgument(f"read_limit {limit} is negative")
        if resource.compressor is not None and limit != 0:
            raise errors.InvalidArgument("read_limit must be 0 when reading compressed-blobs")
        if offset > digest.size_bytes:
            raise errors.OutOfRange(f"read_offset {offset} is past the end of {digest}")
        logs.note(resource=str(digest), offset=offset, limit=limit, compressor=resource.compressor)
        try:  # the empty blob is always there: storage.EmptyBlobStore
            source: AsyncIterator[bytes] = await self.blobs.read(digest, offset, limit)
        except InvalidRange as e:
            raise errors.OutOfRange(str(e)) from None
        chunks = source
        if resource.compressor is not None:
            chunks = zstd_compress_stream(source, digest.size_bytes - offset)
        sent = 0
        # The first message carries the store's first piece as soon as it is read: the client
        # starts receiving while the rest is read (a 64 MiB read's first bytes came 2-3 ms
        # sooner, the whole read about 6 % sooner in 8 of 10 runs: the reads note of 2026-12-06).
        # Every later message but the last carries READ_CHUNK_SIZE bytes, whatever the pieces
        # the store yields (a chunked blob's chunks are 128 KiB-2 MiB): framing copies them once
        # anyway, and fewer messages cost less (the size: server/grpc/__init__.py).
        parts: list[memoryview] = []
        held = 0
        try:
            async for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    take = min(len(view), READ_CHUNK_SIZE - held)
                    parts.append(view[:take])
                    held += take
                    view = view[take:]
                    if held == READ_CHUNK_SIZE:
                        await context.write(read_response(*parts))
                        parts, held = [], 0
                if not sent and parts:  # the first piece: at once
                    await context.write(read_response(*parts))
                    parts, held = [], 0
                sent += len(chunk)
            if parts:
                await context.write(read_response(*parts))
        finally:
            # A client that goes away mid-read must not leave the store's file open.
            await close_chunks(chunks)
            if chunks is not source:
                await close_chunks(source)
        logs.note(bytes=sent)

    @rpc("Write")
    async def Write(
        self, requests: AsyncIterator[bs_pb2.WriteRequest], context: Context
    ) -> bs_pb2.WriteResponse:
        iterator = requests.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            raise errors.InvalidArgument("Write stream with no request") from None
        name = first.resource_name
        resource = parse_write_resource(name)
        key = _upload_key(resource)
        compressed = resource.compressor is not None
        offset = first.write_offset
        logs.note(resource=str(resource.digest), offset=offset, compressor=resource.compressor)

        upload = self.uploads.get(key)
        if upload is not None and upload.attached:
            raise errors.Aborted(f"another Write stream is feeding {name[:200]}")
        if upload is not None and offset != upload.committed:
            if offset != 0:
                raise errors.InvalidArgument(
                    f"write_offset {offset} does not match the committed size {upload.committed} of {name[:200]}"
                )
            upload.abort()  # the client starts over
            upload = None
        if upload is None:
            if await self._exists(resource):
                return bs_pb2.WriteResponse(committed_size=-1 if compressed else resource.digest.size_bytes)
            if offset != 0:
                raise errors.InvalidArgument(
                    f"write_offset {offset} but nothing is committed for {name[:200]}; start at 0"
                )
            upload = self.uploads.start(key, resource, name)

        outcome = upload.attach(first, iterator)
        del first  # the upload holds it until its source takes it
        try:
            result = await outcome
            if result == FINISHED:
                await upload.wait_stored()
            logs.note(bytes=upload.committed, outcome=result)
            if result == CLOSED:
                # The client closed its side without finish_write: the upload stays resumable.
                return bs_pb2.WriteResponse(committed_size=upload.committed)
            return bs_pb2.WriteResponse(committed_size=upload.response_size())
        finally:
            upload.detach()

    @rpc("QueryWriteStatus")
    async def QueryWriteStatus(
        self, request: bs_pb2.QueryWriteStatusRequest, context: Context
    ) -> bs_pb2.QueryWriteStatusResponse:
        resource = parse_write_resource(request.resource_name)
        key = _upload_key(resource)
        upload = self.uploads.get(key)
        if upload is not None:
            return bs_pb2.QueryWriteStatusResponse(committed_size=upload.committed, complete=False)
        committed = self.uploads.completed(key)
        if committed is not None:
            return bs_pb2.QueryWriteStatusResponse(committed_size=committed, complete=True)
        if await self._exists(resource):
            size = -1 if resource.compressor is not None else resource.digest.size_bytes
            return bs_pb2.QueryWriteStatusResponse(committed_size=size, complete=True)
        return bs_pb2.QueryWriteStatusResponse(committed_size=0, complete=False)


def read_response(*parts: bytes | memoryview) -> bytes:
    """The serialized ReadResponse carrying `parts` joined, framed by hand (field 10,
    length-delimited): the same bytes as `ReadResponse(data=b"".join(parts)).SerializeToString()`,
    without building the message, which copied a 1 MiB chunk twice more on the event loop (about
    1 ms against 25 us here)."""
    n = sum(map(len, parts))
    if not n:
        return b""
    header = bytearray(b"\x52")  # field 10 (`data`), wire type 2
    while n > 0x7F:
        header.append(n & 0x7F | 0x80)
        n >>= 7
    header.append(n)
    return b"".join((header, *parts))


def _serialize_read(response: bytes | bs_pb2.ReadResponse) -> bytes:
    """Read's response serializer: the bytes `read_response` framed go out as they are."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_to_server(servicer: ByteStreamService, server: Any) -> None:
    """`add_ByteStreamServicer_to_server` (the generated one), with Read's responses sent as the
    bytes the handler frames (`read_response`)."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Read": grpc.unary_stream_rpc_method_handler(
            servicer.Read, request_deserializer=bs_pb2.ReadRequest.FromString, response_serializer=_serialize_read
        ),
        "Write": grpc.stream_unary_rpc_method_handler(
            servicer.Write,
            request_deserializer=bs_pb2.WriteRequest.FromString,
            response_serializer=bs_pb2.WriteResponse.SerializeToString,
        ),
        "QueryWriteStatus": grpc.unary_unary_rpc_method_handler(
            servicer.QueryWriteStatus,
            request_deserializer=bs_pb2.QueryWriteStatusRequest.FromString,
            response_serializer=bs_pb2.QueryWriteStatusResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
