"""The asset index: (URI + naming qualifiers) or a checksum -> a blob (or a Directory tree) in the CAS.

Entries are action entries of kind `asset` (`ac_namespace(instance, "asset")`), kept by the same
ActionStore as the ActionCache: on disk, and in the bucket when one is configured, so every server
sharing the bucket serves what one of them fetched; they age out by the same LRU. An entry is an
ActionResult, so `buildvault gc` reads the blobs it references like an `ac` entry's:

- a blob: `output_files[0]` (path `asset`) is the blob;
- a directory: `output_directories[0]` holds the root Directory digest and a Tree blob of the
  whole tree (written at push), so gc keeps every file of it; `output_files` (paths `dirs/N`)
  name the other Directory blobs, which GetTree of the root needs and a Tree does not name;
- `execution_metadata.queued_timestamp` is when the content was fetched or pushed (what
  `oldest_content_accepted` is compared with); `auxiliary_metadata[0]` packs a
  FetchBlobResponse / FetchDirectoryResponse with the URI, the qualifiers (never credentials)
  and `expires_at` (a push's `expire_at`).

Keys (the entry's "action digest" is the hash of the key text, with the asset's digest function):
- `uri <URI>` and one line per naming qualifier (`bazel.canonical_id`, `resource_type`, or any
  a pusher gave), sorted;
- `sri <algorithm>-<base64>`: content-addressed, whatever the URL (a tarball mirrored elsewhere is
  the same asset).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf import any_pb2, timestamp_pb2
from google.protobuf.message import DecodeError

from buildvault.assets.request import Checksum
from buildvault.digest import Digest, DigestFunction
from buildvault.remote_apis import ra_pb2, re_pb2
from buildvault.storage import ActionStore, BlobStore, NotFound, StorageError, ac_namespace

__all__ = ["ENTRY_KIND", "AssetIndex", "Entry", "key_digest", "sri_key", "uri_key"]

ENTRY_KIND = "asset"
_WORKER = "buildvault-asset"
_PATH = "asset"


def uri_key(uri: str, named: Sequence[tuple[str, str]]) -> str:
    return "uri " + uri + "\n" + "".join(f"{name}={value}\n" for name, value in sorted(named))


def sri_key(checksum: Checksum) -> str:
    return f"sri {checksum.sri}\n"


def key_digest(key: str, function: DigestFunction) -> Digest:
    # Hashed with the asset's own digest function: storage keys carry it, so a BLAKE3 asset never
    # answers a SHA-256 request, and gc reads the entry's blobs under the right function.
    return Digest.of(key.encode(), function)


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


@dataclass(frozen=True)
class Entry:
    """An index entry: the content (`digest`: a blob, or a root Directory with its `tree`)."""

    digest: Digest
    stored_at: float
    uri: str
    qualifiers: tuple[tuple[str, str], ...]
    expires_at: float | None = None
    tree: Digest | None = None
    subdirectories: tuple[Digest, ...] = ()  # a directory's Directory blobs below the root

    @property
    def is_directory(self) -> bool:
        return self.tree is not None

    def encode(self) -> bytes:
        function = self.digest.function
        aux = any_pb2.Any()
        qualifiers = [ra_pb2.Qualifier(name=n, value=v) for n, v in self.qualifiers]
        expires = _timestamp(self.expires_at) if self.expires_at is not None else None
        result = re_pb2.ActionResult(
            execution_metadata=re_pb2.ExecutedActionMetadata(
                worker=_WORKER, queued_timestamp=_timestamp(self.stored_at)
            )
        )
        if self.tree is None:
            aux.Pack(
                ra_pb2.FetchBlobResponse(
                    uri=self.uri,
                    qualifiers=qualifiers,
                    expires_at=expires,
                    blob_digest=self.digest.to_proto(re_pb2.Digest),
                    digest_function=function.proto,
                )
            )
            result.output_files.append(re_pb2.OutputFile(path=_PATH, digest=self.digest.to_proto(re_pb2.Digest)))
        else:
            aux.Pack(
                ra_pb2.FetchDirectoryResponse(
                    uri=self.uri,
                    qualifiers=qualifiers,
                    expires_at=expires,
                    root_directory_digest=self.digest.to_proto(re_pb2.Digest),
                    digest_function=function.proto,
                )
            )
            result.output_files.extend(
                re_pb2.OutputFile(path=f"dirs/{i}", digest=d.to_proto(re_pb2.Digest))
                for i, d in enumerate(self.subdirectories)
            )
            result.output_directories.append(
                re_pb2.OutputDirectory(
                    path=_PATH,
                    tree_digest=self.tree.to_proto(re_pb2.Digest),
                    root_directory_digest=self.digest.to_proto(re_pb2.Digest),
                )
            )
        result.execution_metadata.auxiliary_metadata.append(aux)
        return result.SerializeToString()

    @classmethod
    def decode(cls, data: bytes, function: DigestFunction) -> Entry | None:
        """None for anything that is not an asset entry of this digest function."""
        try:
            result = re_pb2.ActionResult.FromString(data)
            meta = result.execution_metadata
            if meta.worker != _WORKER or len(meta.auxiliary_metadata) != 1:
                return None
            stored_at = meta.queued_timestamp.ToNanoseconds() / 1e9
            aux = meta.auxiliary_metadata[0]
            if len(result.output_files) == 1 and not result.output_directories:
                blob = ra_pb2.FetchBlobResponse()
                if not aux.Unpack(blob):
                    return None
                return cls(
                    Digest.from_proto(result.output_files[0].digest, function),
                    stored_at,
                    blob.uri,
                    tuple((q.name, q.value) for q in blob.qualifiers),
                    blob.expires_at.ToNanoseconds() / 1e9 if blob.HasField("expires_at") else None,
                )
            if len(result.output_directories) == 1:
                directory = ra_pb2.FetchDirectoryResponse()
                if not aux.Unpack(directory):
                    return None
                out = result.output_directories[0]
                return cls(
                    Digest.from_proto(out.root_directory_digest, function),
                    stored_at,
                    directory.uri,
                    tuple((q.name, q.value) for q in directory.qualifiers),
                    directory.expires_at.ToNanoseconds() / 1e9 if directory.HasField("expires_at") else None,
                    Digest.from_proto(out.tree_digest, function),
                    tuple(Digest.from_proto(f.digest, function) for f in result.output_files),
                )
        except (DecodeError, ValueError):
            return None
        return None


class AssetIndex:
    """Lookups and records over an ActionStore; blob presence is checked against the CAS."""

    def __init__(self, actions: ActionStore, blobs: BlobStore, clock: Callable[[], float] = time.time) -> None:
        self.actions = actions
        self.blobs = blobs
        self.clock = clock
        self.recorded = 0  # entries this server wrote (the status page)

    @staticmethod
    def _where(instance: str, function: DigestFunction, key: str) -> tuple[str, Digest]:
        return ac_namespace(instance, ENTRY_KIND), key_digest(key, function)

    async def get(self, instance: str, function: DigestFunction, key: str) -> Entry | None:
        namespace, digest = self._where(instance, function, key)
        try:
            data = await self.actions.get(namespace, digest)
        except NotFound:
            return None
        return Entry.decode(data, function)

    async def find(
        self,
        instance: str,
        function: DigestFunction,
        keys: Sequence[str],
        *,
        oldest: float | None = None,
        directory: bool = False,
    ) -> Entry | None:
        """The first usable entry under `keys`: of the right shape, not expired, not older than
        `oldest`, and with its content in the CAS (else it is skipped: a miss, fetched again)."""
        now = self.clock()
        for key in keys:
            entry = await self.get(instance, function, key)
            if entry is None or entry.is_directory != directory:
                continue
            if entry.expires_at is not None and entry.expires_at <= now:
                continue
            if oldest is not None and entry.stored_at < oldest:
                continue
            needed = [entry.digest, *([entry.tree] if entry.tree is not None else []), *entry.subdirectories]
            try:
                if await self.blobs.find_missing(needed):
                    continue
            except StorageError:
                continue
            return entry
        return None

    async def record(self, instance: str, keys: Sequence[str], entry: Entry) -> None:
        data = entry.encode()
        for key in keys:
            namespace, digest = self._where(instance, entry.digest.function, key)
            await self.actions.put(namespace, digest, data)
            self.recorded += 1
