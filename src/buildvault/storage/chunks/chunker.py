"""FastCDC 2020 chunk boundaries, as REAPI v2.12 specifies them (ChunkingFunction.FAST_CDC_2020).

The cutting is pyfastcdc's (Cython, ~2 GB/s a core): normalization level 2, min = avg / 4,
max = avg * 4, the seed from `FastCdc2020Params`. It reproduces the specification's published
test vectors (tests/unit/test_chunker.py), so our boundaries are the ones every other client and
server of the same parameters computes, and a chunk one of them stored is found by the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyfastcdc import FastCDC

from buildvault.digest import Digest, DigestFunction, new_hasher
from buildvault.storage import fastsum

# The specification's recommended parameters: average 512 KiB, seed 0.
DEFAULT_AVG_SIZE = 512 * 1024


@dataclass(frozen=True)
class ChunkingParams:
    """FastCDC 2020's two parameters (the rest follow from them)."""

    avg_size: int = DEFAULT_AVG_SIZE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.avg_size < 256 or self.avg_size & (self.avg_size - 1):
            raise ValueError(f"FastCDC average chunk size must be a power of two >= 256, got {self.avg_size}")

    @property
    def min_size(self) -> int:
        return self.avg_size // 4

    @property
    def max_size(self) -> int:
        return self.avg_size * 4

    def cutter(self) -> FastCDC:
        return FastCDC(avg_size=self.avg_size, normalized_chunking=2, seed=self.seed)


def cut(data: bytes | bytearray | memoryview, params: ChunkingParams) -> list[memoryview]:
    """The chunks of a whole buffer, as views into it."""
    if not data:
        return []
    return [chunk.data for chunk in params.cutter().cut_buf(data)]


@dataclass(frozen=True)
class Piece:
    """One chunk of a stream, with its digest and the fast checksum of the same bytes, computed in
    one pass off the event loop (what `BlobStore.store_verified` takes)."""

    digest: Digest
    data: bytes
    fast: bytes


class StreamCutter:
    """FastCDC 2020 over a stream handed over in batches, and the whole stream's hash beside it.

    A batch goes through `join` (the unfinished tail of the batch before plus the new bytes, one
    buffer), then `hash_blob` and `cut` side by side in two worker threads (SHA-256, the cutting
    and the join's copy release the GIL). Batches go one at a time, in order: `join` and `cut` of
    the next batch only after `cut` of this one. The chunks are exactly those of cutting the whole
    stream at once: every chunk of a cut but the last is final whatever follows (its cut point
    depends only on the bytes from its start up to the max size, and it was found before the end
    of the buffer); the last one is final only at the end of the stream, so its bytes are kept and
    cut again with the next batch."""

    def __init__(self, params: ChunkingParams, function: DigestFunction) -> None:
        self.params = params
        self.function = function
        self.blob_hasher = new_hasher(function)
        self._tail = b""

    def join(self, parts: list[bytes]) -> tuple[bytes, int]:
        """The tail and `parts` (emptied) as one buffer, and where the new bytes start in it."""
        tail = self._tail
        self._tail = b""
        buffer = b"".join([tail, *parts]) if parts else tail  # exact bytes: the copy runs without the GIL
        parts.clear()
        return buffer, len(tail)

    def hash_blob(self, buffer: bytes, start: int) -> None:
        """Feed the new bytes of a joined batch to the whole stream's hash."""
        self.blob_hasher.update(memoryview(buffer)[start:] if start else buffer)

    def cut(self, buffer: bytes, final: bool) -> list[Piece]:
        """The final chunks of a joined batch, each named by its hash and with its fast checksum;
        the rest becomes the tail."""
        views = cut(buffer, self.params)
        if not final and views:
            views.pop()
        pieces = []
        used = 0
        function = self.function
        for view in views:
            data = bytes(view)
            hasher = new_hasher(function)
            hasher.update(data)
            pieces.append(Piece(Digest(hasher.hexdigest(), len(data), function), data, fastsum.of(data)))
            used += len(data)
        if not final:
            self._tail = buffer[used:] if used else buffer
        return pieces

    def hexdigest(self) -> str:
        """The whole stream's hash (after the last batch)."""
        return self.blob_hasher.hexdigest()
