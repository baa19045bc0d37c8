"""A small synchronous REAPI v2 client (ActionCache, CAS, ByteStream) with bounded deadlines.

Every call raises `RemoteError` on anything but success or a plain NOT_FOUND, so the caller
can fail open: compile locally and warn once. A write the server refuses with
PERMISSION_DENIED raises `PermissionDenied` (a read-only credential: stop uploading).

Credentials and TLS come from the environment: `BUILDVAULT_TOKEN` (the token) or
`BUILDVAULT_TOKEN_FILE` (a file holding it, read again whenever it changes: CI tokens live
minutes) is sent as `authorization: Bearer …`;
`grpcs://host:port` uses TLS, trusting `BUILDVAULT_TLS_CA` (a PEM file) or the system roots.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Iterator

import grpc

from buildvault.client.chunked import CHUNKED_MIN_SIZE, ChunkCache, chunking_of, chunks_of, default_chunk_cache
from buildvault.client.invocation import current_metadata
from buildvault.digest import Digest
from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2
from buildvault.storage.chunks.chunker import ChunkingParams

# Stay well under the 4 MiB default gRPC message limit of most servers; larger blobs use ByteStream.
BATCH_LIMIT = int(os.environ.get("BUILDVAULT_BATCH_LIMIT", 2 * 1024 * 1024))
CHUNK = min(1024 * 1024, max(BATCH_LIMIT, 4096))
# How long a blob the server had is assumed to still be there (input blobs only matter to
# anyone executing the Action; outputs are always checked by the reader).
PRESENT_TTL = 600.0


class RemoteError(Exception):
    """The remote cache failed, timed out or answered something unusable."""


class PermissionDenied(RemoteError):
    """The server refused a write to this credential (PERMISSION_DENIED): reads still work."""


def parse_remote(url: str) -> str:
    """`grpc://host:port`, `grpcs://host:port` (or plain `host:port`) -> gRPC target."""
    url = url.strip()
    for scheme in ("grpc://", "grpcs://"):
        if url.startswith(scheme):
            url = url[len(scheme):]
    url = url.rstrip("/")
    if not url or ":" not in url:
        raise RemoteError(f"BUILDVAULT_REMOTE={url!r}: want grpc://host:port or grpcs://host:port")
    return url


class TokenSource:
    """The bearer token to send: `BUILDVAULT_TOKEN`, or `BUILDVAULT_TOKEN_FILE` read again whenever
    the file changes (inode, size or mtime), so a long-lived process (buildvault-cc's agent, a
    long `buildvault run`) follows a CI system's short-lived tokens. One stat per call."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        static = env.get("BUILDVAULT_TOKEN", "").strip()
        self.path = None if static else (env.get("BUILDVAULT_TOKEN_FILE") or None)
        self.generation = 0  # bumped each time the token read changes
        self._stamp: tuple[int, int, int] | None = None
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {static}"),) if static else ()
        if self.path is not None:
            self.metadata()  # an unreadable file is an error at once

    def changed(self) -> bool:
        """Whether the file differs from the one last read (False without a file)."""
        if self.path is None:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_ino, st.st_size, st.st_mtime_ns) != self._stamp

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata (`authorization: Bearer …`, or nothing without a token)."""
        path = self.path
        if path is None:
            return self._metadata
        try:
            st = os.stat(path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp == self._stamp:
                return self._metadata
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            if self._stamp is not None:  # replaced non-atomically, for a moment: keep the last token
                return self._metadata
            raise RemoteError(f"BUILDVAULT_TOKEN_FILE={path}: {e.strerror or e}") from None
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if metadata != self._metadata:
            self.generation += 1
        self._stamp, self._metadata = stamp, metadata
        return metadata


def channel_credentials(env: dict[str, str] | None = None) -> grpc.ChannelCredentials:
    """TLS credentials for grpcs://: the CA in BUILDVAULT_TLS_CA, else the system roots."""
    env = dict(os.environ) if env is None else env
    path = env.get("BUILDVAULT_TLS_CA")
    if not path:
        return grpc.ssl_channel_credentials()
    try:
        with open(path, "rb") as f:
            return grpc.ssl_channel_credentials(root_certificates=f.read())
    except OSError as e:
        raise RemoteError(f"BUILDVAULT_TLS_CA={path}: {e.strerror or e}") from None


def open_channel(url: str, options: list[tuple[str, int]] | None = None) -> grpc.Channel:
    """A channel to `grpc://host:port` (plain) or `grpcs://host:port` (TLS: channel_credentials)."""
    target = parse_remote(url)
    options = [("grpc.enable_http_proxy", 0)] if options is None else options
    if url.strip().startswith("grpcs://"):
        return grpc.secure_channel(target, channel_credentials(), options=options)
    return grpc.insecure_channel(target, options=options)


def _error(call: str, e: grpc.RpcError) -> RemoteError:
    kind = PermissionDenied if e.code() == grpc.StatusCode.PERMISSION_DENIED else RemoteError
    return kind(f"{call}: {e.code().name}: {e.details()}")


class Remote:
    def __init__(self, url: str, instance: str = "", timeout: float = 5.0, upload_timeout: float = 30.0):
        self.target = parse_remote(url)
        self.instance = instance
        self.timeout = timeout
        self.upload_timeout = upload_timeout
        options = [
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            # Reconnect quickly once a restarted server is back.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.enable_http_proxy", 0),
        ]
        self.channel = open_channel(url, options)
        self.tokens = TokenSource()
        self.ac = re_grpc.ActionCacheStub(self.channel)
        self.cas = re_grpc.ContentAddressableStorageStub(self.channel)
        self.bs = bs_grpc.ByteStreamStub(self.channel)
        self.present: dict[Digest, float] = {}  # blob -> when the server last had it
        self.chunk_cache: ChunkCache | None = default_chunk_cache()
        self._chunking: ChunkingParams | None | bool = False  # False: not asked yet
        self.bytes_uploaded = 0  # blob bytes sent (chunks, batches, streams): what chunking saves
        self.bytes_downloaded = 0

    @property
    def metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """Each call's metadata: the current token (the token file is read again when it changes),
        and the RequestMetadata of the build step being served, when one is open (invocation.py)."""
        extra = current_metadata()
        base: tuple[tuple[str, str | bytes], ...] = self.tokens.metadata()
        return base + (extra,) if extra is not None else base

    def close(self) -> None:
        self.channel.close()

    # -- action cache ------------------------------------------------------------------------
    def get_action_result(self, digest: Digest, inline_files: Iterable[str] = ()) -> re_pb2.ActionResult | None:
        """The cached result, asking the server to inline stdout, stderr and `inline_files`."""
        request = re_pb2.GetActionResultRequest(
            instance_name=self.instance,
            action_digest=digest.to_proto(re_pb2.Digest),
            inline_stdout=True,
            inline_stderr=True,
            inline_output_files=list(inline_files),
        )
        try:
            result: re_pb2.ActionResult = self.ac.GetActionResult(request, timeout=self.timeout, metadata=self.metadata)
            return result
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise RemoteError(f"GetActionResult: {e.code().name}: {e.details()}") from None

    def update_action_result(self, digest: Digest, result: re_pb2.ActionResult) -> None:
        self.update_action_results([(digest, result)])

    def update_action_results(self, updates: list[tuple[Digest, re_pb2.ActionResult]]) -> None:
        """Several UpdateActionResult calls in flight at once."""
        futures = [
            self.ac.UpdateActionResult.future(
                re_pb2.UpdateActionResultRequest(instance_name=self.instance, action_digest=d.to_proto(re_pb2.Digest),
                                                 action_result=r),
                timeout=self.upload_timeout,
                metadata=self.metadata,
            )
            for d, r in updates
        ]
        for future in futures:
            try:
                future.result()
            except grpc.RpcError as e:
                raise _error("UpdateActionResult", e) from None

    # -- CAS ---------------------------------------------------------------------------------
    def find_missing(self, digests: Iterable[Digest]) -> set[Digest]:
        """The blobs the server lacks. Blobs seen present (or uploaded) within PRESENT_TTL are
        not asked about again: a build's compiles share most headers."""
        now = time.monotonic()
        unique = [
            d for d in dict.fromkeys(d for d in digests if d.size_bytes > 0)
            if now - self.present.get(d, -PRESENT_TTL) >= PRESENT_TTL
        ]
        missing: set[Digest] = set()
        for start in range(0, len(unique), 5000):
            part = unique[start:start + 5000]
            request = re_pb2.FindMissingBlobsRequest(instance_name=self.instance,
                                                     blob_digests=[d.to_proto(re_pb2.Digest) for d in part])
            try:
                response = self.cas.FindMissingBlobs(request, timeout=self.upload_timeout, metadata=self.metadata)
            except grpc.RpcError as e:
                raise RemoteError(f"FindMissingBlobs: {e.code().name}: {e.details()}") from None
            missing.update(Digest.from_proto(d) for d in response.missing_blob_digests)
        if len(self.present) > 1_000_000:
            self.present.clear()
        for d in unique:
            if d not in missing:
                self.present[d] = now
        return missing

    # -- chunked transfers (REAPI v2.12) ----------------------------------------------------------
    def chunking(self) -> ChunkingParams | None:
        """The server's FastCDC 2020 parameters when it splits and splices (asked once)."""
        if self._chunking is False:
            try:
                reply = re_grpc.CapabilitiesStub(self.channel).GetCapabilities(
                    re_pb2.GetCapabilitiesRequest(instance_name=self.instance), timeout=self.timeout,
                    metadata=self.metadata,
                )
                self._chunking = chunking_of(reply)
            except grpc.RpcError:
                self._chunking = None
        return self._chunking if isinstance(self._chunking, ChunkingParams) else None

    def _upload_chunked(self, digest: Digest, data: bytes, params: ChunkingParams) -> bool:
        """Send only the chunks the server lacks, then SpliceBlob; False if the server refused
        splicing (the caller sends the blob whole)."""
        chunks = chunks_of(data, params)
        by_digest = {c.digest: c.data for c in chunks}
        if self.chunk_cache is not None:
            for c in chunks:
                self.chunk_cache.put(c.digest, c.data)
        missing = self.find_missing(by_digest)
        self.upload({d: by_digest[d] for d in missing}, whole=True)
        request = re_pb2.SpliceBlobRequest(
            instance_name=self.instance, blob_digest=digest.to_proto(re_pb2.Digest),
            chunk_digests=[c.digest.to_proto(re_pb2.Digest) for c in chunks],
            chunking_function=re_pb2.ChunkingFunction.FAST_CDC_2020,
        )
        try:
            self.cas.SpliceBlob(request, timeout=self.upload_timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
                return False  # not offered after all, or a chunk evicted meanwhile: send whole
            raise _error("SpliceBlob", e) from None
        return True

    def _download_chunked(self, digest: Digest) -> bytes | None:
        """The blob from its chunk list, fetching only the chunks the chunk cache lacks (None:
        the server could not split it; the caller reads it whole)."""
        request = re_pb2.SplitBlobRequest(instance_name=self.instance, blob_digest=digest.to_proto(re_pb2.Digest))
        try:
            reply = self.cas.SplitBlob(request, timeout=self.upload_timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise RemoteError(f"SplitBlob: blob {digest} not found") from None
            return None
        listed = [Digest.from_proto(d) for d in reply.chunk_digests]
        have = self.download(listed, whole=True)  # the chunk cache answers what it holds
        return b"".join(have[d] for d in listed)

    def upload(self, blobs: dict[Digest, bytes], whole: bool = False) -> None:
        """Upload the given blobs (caller already filtered with find_missing); a large blob goes
        as the chunks the server lacks when it splices (`whole`: never, e.g. for chunks)."""
        batch: list[tuple[Digest, bytes]] = []
        size = 0
        for digest, data in blobs.items():
            if digest.size_bytes == 0:
                continue
            if digest.size_bytes >= CHUNKED_MIN_SIZE and not whole:
                params = self.chunking()
                if params is not None and self._upload_chunked(digest, data, params):
                    continue
            if digest.size_bytes > BATCH_LIMIT:
                self._write(digest, data)
                continue
            if size + digest.size_bytes > BATCH_LIMIT and batch:
                self._batch_update(batch)
                batch, size = [], 0
            batch.append((digest, data))
            size += digest.size_bytes
        if batch:
            self._batch_update(batch)
        now = time.monotonic()
        for digest in blobs:
            self.present[digest] = now

    def _batch_update(self, batch: list[tuple[Digest, bytes]]) -> None:
        request = re_pb2.BatchUpdateBlobsRequest(
            instance_name=self.instance,
            requests=[
                re_pb2.BatchUpdateBlobsRequest.Request(digest=d.to_proto(re_pb2.Digest), data=b) for d, b in batch
            ],
        )
        try:
            response = self.cas.BatchUpdateBlobs(request, timeout=self.upload_timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise _error("BatchUpdateBlobs", e) from None
        self.bytes_uploaded += sum(len(b) for _, b in batch)
        for r in response.responses:
            if r.status.code != 0:
                raise RemoteError(f"BatchUpdateBlobs: blob {r.digest.hash}: code {r.status.code}: {r.status.message}")

    def _write(self, digest: Digest, data: bytes) -> None:
        prefix = f"{self.instance}/" if self.instance else ""
        name = f"{prefix}uploads/{uuid.uuid4()}/blobs/{digest.hash}/{digest.size_bytes}"

        def chunks() -> Iterator[bs_pb2.WriteRequest]:
            offset = 0
            while True:
                piece = data[offset:offset + CHUNK]
                last = offset + len(piece) >= len(data)
                yield bs_pb2.WriteRequest(
                    resource_name=name if offset == 0 else "", write_offset=offset, finish_write=last, data=piece
                )
                offset += len(piece)
                if last:
                    return

        try:
            response = self.bs.Write(chunks(), timeout=self.upload_timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                return
            raise _error("ByteStream.Write", e) from None
        if response.committed_size not in (digest.size_bytes, -1):
            raise RemoteError(f"ByteStream.Write committed {response.committed_size} of {digest.size_bytes} bytes")
        self.bytes_uploaded += len(data)

    def download(self, digests: Iterable[Digest], whole: bool = False) -> dict[Digest, bytes]:
        """Fetch blobs and verify each against its digest; a large blob as the chunks the chunk
        cache lacks when the server splits (`whole`: never, e.g. for chunks)."""
        out: dict[Digest, bytes] = {}
        small: list[Digest] = []
        cache = self.chunk_cache
        for d in dict.fromkeys(digests):
            cached = cache.get(d) if cache is not None and d.size_bytes > 0 else None
            if cached is not None:
                out[d] = cached
            elif d.size_bytes == 0:
                out[d] = b""
            elif d.size_bytes >= CHUNKED_MIN_SIZE and not whole and self.chunking() is not None:
                joined = self._download_chunked(d)
                out[d] = joined if joined is not None else self._read(d)
            elif d.size_bytes > BATCH_LIMIT:
                out[d] = self._read(d)
            else:
                small.append(d)
        batch: list[Digest] = []
        size = 0
        for d in small:
            if size + d.size_bytes > BATCH_LIMIT and batch:
                out.update(self._batch_read(batch))
                batch, size = [], 0
            batch.append(d)
            size += d.size_bytes
        if batch:
            out.update(self._batch_read(batch))
        for d, data in out.items():
            if Digest.of(data) != d:
                raise RemoteError(f"blob {d} failed verification")
            if cache is not None:
                cache.put(d, data)
        return out

    def _batch_read(self, batch: list[Digest]) -> dict[Digest, bytes]:
        digests = [d.to_proto(re_pb2.Digest) for d in batch]
        request = re_pb2.BatchReadBlobsRequest(instance_name=self.instance, digests=digests)
        try:
            response = self.cas.BatchReadBlobs(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise RemoteError(f"BatchReadBlobs: {e.code().name}: {e.details()}") from None
        out = {}
        for r in response.responses:
            if r.status.code != 0:
                raise RemoteError(f"BatchReadBlobs: blob {r.digest.hash}: code {r.status.code}: {r.status.message}")
            out[Digest.from_proto(r.digest)] = r.data
            self.bytes_downloaded += len(r.data)
        if len(out) != len(batch):
            raise RemoteError("BatchReadBlobs: incomplete answer")
        return out

    def _read(self, digest: Digest) -> bytes:
        prefix = f"{self.instance}/" if self.instance else ""
        name = f"{prefix}blobs/{digest.hash}/{digest.size_bytes}"
        try:
            request = bs_pb2.ReadRequest(resource_name=name)
            reads = self.bs.Read(request, timeout=max(self.timeout, 30.0), metadata=self.metadata)
            parts = [r.data for r in reads]
        except grpc.RpcError as e:
            raise RemoteError(f"ByteStream.Read: {e.code().name}: {e.details()}") from None
        data = b"".join(parts)
        self.bytes_downloaded += len(data)
        return data
