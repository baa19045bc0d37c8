"""ContentAddressableStorage over gRPC: FindMissingBlobs, batch update/read, GetTree."""

from __future__ import annotations

import asyncio
import base64
import binascii
import operator
import zlib
from collections import deque
from collections.abc import Sequence
from typing import cast

from google.protobuf.message import DecodeError

from buildvault import logs
from buildvault.actions import read_blob
from buildvault.compression import offload, zstd_compress, zstd_decompress_whole
from buildvault.digest import Digest, DigestFunction, InvalidDigest, all_hashes, verify_instance_name
from buildvault.remote_apis import re_pb2
from buildvault.server import errors
from buildvault.server.grpc import MAX_BATCH_TOTAL_SIZE, Context, rpc
from buildvault.storage import BlobStore, NotFound
from buildvault.storage.chunks import ChunkedBlobStore
from buildvault.storage.chunks.store import MAX_SPLICE_CHUNKS

IDENTITY = re_pb2.Compressor.IDENTITY
ZSTD = re_pb2.Compressor.ZSTD

# A compressed BatchUpdateBlobs entry may expand to at most this many bytes (bigger blobs
# belong on ByteStream): bounds the memory one request can make the server allocate.
MAX_BATCH_BLOB_UNCOMPRESSED = 64 << 20
# GetTree: directories per response when the client does not say, and the most we send at once.
DEFAULT_TREE_PAGE = 1000
MAX_TREE_PAGE = 10_000
# GetTree: Directory blobs read concurrently, and the payload bytes per response page.
TREE_READ_PARALLELISM = 64
MAX_TREE_PAGE_BYTES = MAX_BATCH_TOTAL_SIZE
_TOKEN_PREFIX = "t1."


_get_hash = operator.attrgetter("hash")
_get_size = operator.attrgetter("size_bytes")
# Digest is a frozen slotted dataclass; its generated __init__ costs ~0.7 us. For already
# validated fields, setting the slots directly is 3x faster (FindMissingBlobs of 1,000 digests).
_new = object.__new__
_set_hash = Digest.__dict__["hash"].__set__
_set_size = Digest.__dict__["size_bytes"].__set__
_set_function = Digest.__dict__["function"].__set__


def _digest(hash: str, size: int, function: DigestFunction) -> Digest:
    digest = _new(Digest)
    _set_hash(digest, hash)
    _set_size(digest, size)
    _set_function(digest, function)
    return digest


def _fields(messages: Sequence[re_pb2.Digest], function: DigestFunction) -> tuple[list[str], list[int]]:
    """The hashes and sizes of many Digest messages, validated in bulk (InvalidDigest names the first bad one)."""
    items = list(messages)  # one wrapper per element, not one per field access
    hashes = list(map(_get_hash, items))
    sizes = list(map(_get_size, items))
    if hashes and not (all_hashes(hashes) and min(sizes) >= 0):
        for h, s in zip(hashes, sizes, strict=True):  # something is malformed: let Digest.parse name it
            Digest.parse(h, s, function)
    return hashes, sizes


def parse_digests(messages: Sequence[re_pb2.Digest], function: DigestFunction) -> list[Digest]:
    """Validate and convert many Digest messages: one check over all hashes, then no per-item checks."""
    hashes, sizes = _fields(messages, function)
    return [_digest(h, s, function) for h, s in zip(hashes, sizes, strict=True)]


class CasService:
    """build.bazel.remote.execution.v2.ContentAddressableStorage."""

    def __init__(
        self,
        blobs: BlobStore,
        max_batch_total_size: int = MAX_BATCH_TOTAL_SIZE,
        chunks: ChunkedBlobStore | None = None,
    ) -> None:
        self.blobs = blobs
        self.max_batch_total_size = max_batch_total_size
        self.chunks = chunks

    @rpc("FindMissingBlobs")
    async def FindMissingBlobs(
        self, request: re_pb2.FindMissingBlobsRequest, context: Context
    ) -> re_pb2.FindMissingBlobsResponse:
        verify_instance_name(request.instance_name)
        function = DigestFunction.from_wire(request.digest_function)
        # No Digest objects on the hot path; the reply echoes the request's messages.
        messages = request.blob_digests
        hashes, sizes = _fields(messages, function)
        absent = await self.blobs.find_missing_indices(function, hashes, sizes)  # empty blob: storage.EmptyBlobStore
        logs.note(digests=len(hashes), missing=len(absent))
        return re_pb2.FindMissingBlobsResponse(missing_blob_digests=[messages[i] for i in absent])

    @rpc("BatchUpdateBlobs")
    async def BatchUpdateBlobs(
        self, request: re_pb2.BatchUpdateBlobsRequest, context: Context
    ) -> re_pb2.BatchUpdateBlobsResponse:
        verify_instance_name(request.instance_name)
        function = DigestFunction.from_wire(request.digest_function)
        total = sum(len(entry.data) for entry in request.requests)
        if total > self.max_batch_total_size:
            raise errors.InvalidArgument(
                f"BatchUpdateBlobs carries {total} bytes, over the advertised max_batch_total_size_bytes "
                f"{self.max_batch_total_size}: split the batch or use ByteStream.Write"
            )
        entries = request.requests
        outcomes: list[Exception | None] = [None] * len(entries)
        items: list[tuple[Digest, bytes]] = []
        where: list[int] = []
        for i, entry in enumerate(entries):
            try:
                items.append((Digest.from_proto(entry.digest, function), await self._uncompressed(entry)))
                where.append(i)
            except Exception as exc:  # per-blob status
                outcomes[i] = exc
        for i, outcome in zip(where, await self.blobs.write_blobs(items), strict=True):  # one store call for the batch
            outcomes[i] = outcome
        failed = 0
        response = re_pb2.BatchUpdateBlobsResponse()
        add = response.responses.add
        for entry, outcome in zip(entries, outcomes, strict=True):
            if outcome is None:
                add(digest=entry.digest)  # an unset status is OK (code 0)
            else:
                failed += 1
                if errors.is_internal(outcome):
                    errors.log.error("BatchUpdateBlobs: internal error on one blob", exc_info=outcome)
                add(digest=entry.digest, status=errors.rpc_status(outcome))
        logs.note(blobs=len(entries), bytes=total, failed=failed)
        return response

    async def _uncompressed(self, entry: re_pb2.BatchUpdateBlobsRequest.Request) -> bytes:
        if entry.compressor == IDENTITY:
            return entry.data
        if entry.compressor == ZSTD:
            if entry.digest.size_bytes > MAX_BATCH_BLOB_UNCOMPRESSED:
                raise errors.InvalidArgument(
                    f"blob {entry.digest.hash}/{entry.digest.size_bytes} is too large for a compressed batch entry; "
                    "use ByteStream.Write"
                )
            return await zstd_decompress_whole(entry.data, entry.digest.size_bytes)
        raise errors.InvalidArgument(f"unsupported compressor {entry.compressor}; this server supports zstd")

    @rpc("BatchReadBlobs")
    async def BatchReadBlobs(
        self, request: re_pb2.BatchReadBlobsRequest, context: Context
    ) -> re_pb2.BatchReadBlobsResponse:
        verify_instance_name(request.instance_name)
        function = DigestFunction.from_wire(request.digest_function)
        total = sum(max(0, d.size_bytes) for d in request.digests)
        if total > self.max_batch_total_size:
            raise errors.InvalidArgument(
                f"BatchReadBlobs asks for {total} bytes, over the advertised max_batch_total_size_bytes "
                f"{self.max_batch_total_size}: split the batch or use ByteStream.Read"
            )
        compress = ZSTD in request.acceptable_compressors
        messages = request.digests
        outcomes: list[bytes | Exception] = [b""] * len(messages)
        wanted: list[Digest] = []
        where: list[int] = []
        try:
            digests: Sequence[Digest | None] = parse_digests(messages, function)  # all valid: the usual case
        except InvalidDigest:
            digests = [None] * len(messages)
        for i, (message, digest) in enumerate(zip(messages, digests, strict=True)):
            if digest is None:
                try:
                    digest = Digest.from_proto(message, function)
                except Exception as exc:  # per-blob status
                    outcomes[i] = exc
                    continue
            wanted.append(digest)  # the empty blob is always there: storage.EmptyBlobStore
            where.append(i)
        for i, outcome in zip(where, await self.blobs.read_blobs(wanted), strict=True):  # one store call for the batch
            outcomes[i] = outcome
        logs.note(blobs=len(messages), bytes=total)
        response = re_pb2.BatchReadBlobsResponse()
        add = response.responses.add
        for message, outcome in zip(messages, outcomes, strict=True):
            if isinstance(outcome, Exception):
                if errors.is_internal(outcome):
                    errors.log.error("BatchReadBlobs: internal error on one blob", exc_info=outcome)
                add(digest=message, status=errors.rpc_status(outcome))
            elif compress:
                add(digest=message, data=await offload(zstd_compress, outcome), compressor=ZSTD)
            else:
                add(digest=message, data=outcome)  # an unset status is OK (code 0)
        return response

    @rpc("GetTree")
    async def GetTree(self, request: re_pb2.GetTreeRequest, context: Context) -> None:
        verify_instance_name(request.instance_name)
        function = DigestFunction.from_wire(request.digest_function)
        root = Digest.from_proto(request.root_digest, function)
        if request.page_size < 0:
            raise errors.InvalidArgument(f"page_size {request.page_size} is negative")
        page_size = min(request.page_size or DEFAULT_TREE_PAGE, MAX_TREE_PAGE)
        queue = deque(_decode_token(request.page_token, root) if request.page_token else [root])
        seen: set[Digest] = set(queue)
        first_call = not request.page_token
        page: list[re_pb2.Directory] = []
        page_bytes = 0
        pages = directories = 0

        async def flush(remaining: list[Digest]) -> None:
            nonlocal page, page_bytes, pages
            token = _encode_token(remaining, root) if remaining else ""
            await context.write(re_pb2.GetTreeResponse(directories=page, next_page_token=token))
            pages += 1
            page, page_bytes = [], 0

        while queue:
            take = min(TREE_READ_PARALLELISM, page_size - len(page), len(queue))
            batch = [queue.popleft() for _ in range(take)]
            blobs = await asyncio.gather(*(read_blob(self.blobs, d) for d in batch), return_exceptions=True)
            for index, (digest, data) in enumerate(zip(batch, blobs, strict=True)):
                if isinstance(data, BaseException):
                    if not isinstance(data, NotFound):
                        raise data
                    if first_call and digest == root:
                        raise NotFound(f"GetTree root directory {root} is not in the CAS")
                    continue  # the spec: return the part of the tree that is present
                try:
                    directory = re_pb2.Directory.FromString(data)
                except DecodeError:
                    if first_call and digest == root:
                        raise errors.InvalidArgument(f"GetTree root {root} is not a Directory message") from None
                    continue
                if page and page_bytes + len(data) > MAX_TREE_PAGE_BYTES:
                    await flush([*batch[index:], *queue])
                page.append(directory)
                page_bytes += len(data)
                directories += 1
                for node in directory.directories:
                    try:
                        child = Digest.from_proto(node.digest, function)
                    except InvalidDigest:
                        continue
                    if child not in seen:
                        seen.add(child)
                        queue.append(child)
            if len(page) >= page_size and queue:
                await flush(list(queue))
        if page or pages == 0:
            await flush([])
        logs.note(root=str(root), directories=directories, pages=pages)

    @rpc("SplitBlob")
    async def SplitBlob(self, request: re_pb2.SplitBlobRequest, context: Context) -> re_pb2.SplitBlobResponse:
        """"The blob is split into chunks which are individually stored in the CAS": a blob stored
        whole is chunked now, so every chunk returned is readable afterwards."""
        chunks = self._chunking("SplitBlob")
        verify_instance_name(request.instance_name)
        function = DigestFunction.from_wire(request.digest_function)
        _check_chunking_function(request.chunking_function)
        digest = Digest.from_proto(request.blob_digest, function)
        listed = await chunks.split(digest)
        logs.note(blob=str(digest), chunks=len(listed))
        return re_pb2.SplitBlobResponse(
            chunk_digests=[c.to_proto(re_pb2.Digest) for c in listed],
            chunking_function=re_pb2.ChunkingFunction.FAST_CDC_2020,
        )

    @rpc("SpliceBlob")
    async def SpliceBlob(self, request: re_pb2.SpliceBlobRequest, context: Context) -> re_pb2.SpliceBlobResponse:
        """Every chunk must be present (NOT_FOUND naming the missing ones) and their concatenation
        must hash to `blob_digest` (INVALID_ARGUMENT); either way nothing is stored then."""
        chunks = self._chunking("SpliceBlob")
        verify_instance_name(request.instance_name)
        function = DigestFunction.from_wire(request.digest_function)
        _check_chunking_function(request.chunking_function)
        digest = Digest.from_proto(request.blob_digest, function)
        if len(request.chunk_digests) > MAX_SPLICE_CHUNKS:
            raise errors.InvalidArgument(
                f"{len(request.chunk_digests)} chunk digests; at most {MAX_SPLICE_CHUNKS} per SpliceBlob"
            )
        listed = parse_digests(request.chunk_digests, function)
        await chunks.splice(digest, listed)
        logs.note(blob=str(digest), chunks=len(listed))
        return re_pb2.SpliceBlobResponse(blob_digest=request.blob_digest)

    def _chunking(self, method: str) -> ChunkedBlobStore:
        if self.chunks is None:
            raise errors.Unimplemented(f"{method} is not offered: chunking is off on this server")
        return self.chunks


def _check_chunking_function(value: int) -> None:
    """Any function the enum names is accepted (blobs are re-chunked with the server's own); a
    value it does not name is a malformed request."""
    if value not in re_pb2.ChunkingFunction.Value.values():
        raise errors.InvalidArgument(f"unknown chunking_function {value}")


def _encode_token(pending: list[Digest], root: Digest) -> str:
    """A page token: the directories still to visit, bound to the root they belong to."""
    state = re_pb2.FindMissingBlobsRequest(
        instance_name=f"{root.hash}/{root.size_bytes}",
        blob_digests=[d.to_proto(re_pb2.Digest) for d in pending],
        digest_function=cast("re_pb2.DigestFunction.Value", root.function.wire),
    )
    packed = zlib.compress(state.SerializeToString(), 6)
    return _TOKEN_PREFIX + base64.urlsafe_b64encode(packed).decode("ascii")


def _decode_token(token: str, root: Digest) -> list[Digest]:
    if not token.startswith(_TOKEN_PREFIX):
        raise errors.InvalidArgument("invalid GetTree page_token")
    try:
        packed = base64.urlsafe_b64decode(token[len(_TOKEN_PREFIX) :].encode("ascii"))
        state = re_pb2.FindMissingBlobsRequest.FromString(zlib.decompress(packed))
        if state.instance_name != f"{root.hash}/{root.size_bytes}" or state.digest_function != root.function.wire:
            raise errors.InvalidArgument("GetTree page_token belongs to another root_digest")
        return parse_digests(state.blob_digests, root.function)
    except (binascii.Error, ValueError, zlib.error, DecodeError):
        raise errors.InvalidArgument("invalid GetTree page_token") from None
