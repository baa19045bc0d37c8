"""Content-defined chunking (REAPI v2.12 SplitBlob / SpliceBlob, FastCDC 2020): the chunker and
the store decorator that keeps large blobs as shared chunks plus a chunk list."""

from buildvault.storage.chunks.chunker import ChunkingParams, cut
from buildvault.storage.chunks.store import DEFAULT_THRESHOLD, ChunkedBlobStore, MissingChunks

__all__ = ["DEFAULT_THRESHOLD", "ChunkedBlobStore", "ChunkingParams", "MissingChunks", "cut"]
