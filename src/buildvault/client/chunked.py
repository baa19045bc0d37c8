"""Sending and fetching large blobs as the chunks that changed (REAPI v2.12 SplitBlob/SpliceBlob).

A client that has a large blob cuts it with the FastCDC 2020 parameters the server advertises,
asks which chunks the server lacks, uploads only those and splices the blob from the list. A
client that wants a large blob asks for its chunk list and downloads only the chunks it does not
already hold in its chunk cache (a directory of verified chunk files). Against a server that
does not advertise both calls, everything falls back to whole-blob transfers.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2
from buildvault.storage.chunks.chunker import ChunkingParams, cut

# Blobs below this go whole: the server keeps them whole too, and a small blob rarely shares much.
CHUNKED_MIN_SIZE = 2 << 20


def chunking_of(capabilities: re_pb2.ServerCapabilities) -> ChunkingParams | None:
    """The FastCDC 2020 parameters to cut with, or None when the server cannot split and splice."""
    cache = capabilities.cache_capabilities
    if not (cache.split_blob_support and cache.splice_blob_support and cache.HasField("fast_cdc_2020_params")):
        return None
    params = cache.fast_cdc_2020_params
    try:
        return ChunkingParams(avg_size=params.avg_chunk_size_bytes, seed=params.seed)
    except ValueError:  # parameters we cannot reproduce: send whole
        return None


@dataclass(frozen=True)
class Chunk:
    digest: Digest
    data: bytes


def chunks_of(data: bytes, params: ChunkingParams) -> list[Chunk]:
    out = []
    for view in cut(data, params):
        piece = bytes(view)
        out.append(Chunk(Digest.of(piece), piece))
    return out


class ChunkCache:
    """Chunks and blobs this machine has fetched or sent, one file each named by its hash; every
    read verified.

    Shared by concurrent processes: a chunk is published by rename, so a reader sees it whole or
    not at all."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def _path(self, digest: Digest) -> Path:
        return self.directory / digest.hash[:2] / digest.hash

    def get(self, digest: Digest) -> bytes | None:
        try:
            data = self._path(digest).read_bytes()
        except OSError:
            return None
        return data if Digest.of(data) == digest else None

    def put(self, digest: Digest, data: bytes) -> None:
        path = self._path(digest)
        if path.exists():
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temp, path)
        except OSError:
            pass  # a cache: a full or read-only disk only costs a later download


def default_chunk_cache(env: dict[str, str] | None = None) -> ChunkCache | None:
    """`BUILDVAULT_CHUNK_CACHE` (a directory; empty: none). Unbounded: point it at a directory
    the machine's own clean-up ages (a CI runner's cache, a tmpfs)."""
    env = dict(os.environ) if env is None else env
    directory = env.get("BUILDVAULT_CHUNK_CACHE", "")
    return ChunkCache(directory) if directory else None
