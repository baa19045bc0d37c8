"""Action entries kept in memory, so a GetActionResult hit makes no trip to the worker threads.

Entries recently written or read, first in first out within AC_CACHE_BYTES; the index keeps it
current (an entry replaced or evicted leaves it at once).
"""

from __future__ import annotations

AC_CACHE_BYTES = 4 << 20


class AcCache:
    """AC key -> entry bytes, oldest first. An entry over 1/64 of the capacity is not kept."""

    __slots__ = ("_entries", "nbytes")

    def __init__(self) -> None:
        self._entries: dict[bytes, bytes] = {}
        self.nbytes = 0  # bytes held

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> bytes | None:
        return self._entries.get(key)

    def put(self, key: bytes, data: bytes) -> None:
        if len(data) > AC_CACHE_BYTES // 64:
            return
        self.discard(key)
        entries = self._entries
        entries[key] = data
        self.nbytes += len(data)
        while self.nbytes > AC_CACHE_BYTES:
            self.discard(next(iter(entries)))

    def discard(self, key: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= len(old)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def held_bytes(self) -> int:
        """The sum of the held entries' sizes (recounted: `nbytes` must equal it)."""
        return sum(map(len, self._entries.values()))
