"""Reading blob and entry files back in the store's worker threads (a streamed chunk or a whole
file the page cache holds, on the event loop: `pread_cached`, `read_cached`, asked of
pagecache.py), every whole read verified.

A whole read (`read_many`, `open_range` + `Check`) verifies the file's fast checksum
(fileops.FAST_XATTR, XXH3-64) instead of its digest. A file without one (written before it was
recorded, copied without its attributes, or on a filesystem without user xattrs) is verified
against its digest, and the checksum recorded once that matched: blobs are content-addressed, so
the checksum of a path's verified content is right for every file that path will ever hold.
Outcomes are fileops' OK, MISSING, DAMAGED and FAILED, as for records.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from typing import Any

from buildvault.digest import Digest, Hasher, new_hasher
from buildvault.storage import fastsum
from buildvault.storage.disk import fileops, pagecache
from buildvault.storage.disk.fileops import DAMAGED, FAILED, MISSING, OK


class Check:
    """The verification of one whole-file read, fed in order one chunk at a time (in the worker
    threads, or on the event loop for a chunk read from the page cache): the fast
    checksum recorded with the file, or (a file without one) its digest, recording the checksum
    once the digest matched. `ok` once `finish` found the content right."""

    __slots__ = ("digest", "recorded", "fast", "full", "ok")

    def __init__(self, digest: Digest) -> None:
        self.digest = digest
        self.recorded: bytes | None = None
        self.fast = fastsum.new()
        self.full: Hasher | None = None
        self.ok = False

    def start(self, fd: int) -> None:
        self.recorded = fileops.recorded_sum(fd)
        if self.recorded is None:
            self.full = new_hasher(self.digest.function)

    def update(self, data: bytes) -> None:
        self.fast.update(data)
        if self.full is not None:
            self.full.update(data)

    def finish(self, fd: int) -> bool:
        """After the last byte: whether the content is right (recording the checksum if it was verified by digest)."""
        fast = self.fast.digest()
        if self.full is None:
            self.ok = fast == self.recorded
        else:
            self.ok = self.full.hexdigest() == self.digest.hash
            if self.ok:
                fileops.record_sum(fd, fast)
        return self.ok


def read_small(path: str, digest: Digest, offset: int, end: int) -> tuple[int, bytes]:
    """Bytes [offset, end) of a whole small blob file, verified whole against `digest` first."""
    found = read_many([(path, digest)])[0]
    status, data = found
    if isinstance(data, OSError):
        raise data
    return status, data[offset:end] if status == OK else b""


def read_many(items: list[tuple[str, Digest]]) -> list[tuple[int, bytes | OSError]]:
    """Whole small blob files in one trip, each verified by size and its fast checksum (or its digest,
    see the module docstring): (status, bytes) each, or (FAILED, the OSError). Reading one byte
    more than the size finds a longer file without a stat."""
    results: list[tuple[int, bytes | OSError]] = []
    append = results.append
    flags = os.O_RDONLY | os.O_CLOEXEC
    for path, digest in items:
        size = digest.size_bytes
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            append((MISSING, b""))
            continue
        except OSError as e:
            append((FAILED, e))
            continue
        try:
            data = os.read(fd, size + 1)
            if len(data) < size:  # a short read of a regular file is the end of it, unless a signal cut it
                data += _read_rest(fd, size - len(data) + 1)
            append((OK, data) if len(data) == size and _verified(fd, data, digest) else (DAMAGED, b""))
        except OSError as e:
            append((FAILED, e))
        finally:
            os.close(fd)
    return results


def read_cached(path: str, digest: Digest) -> bytes | None:
    """`read_many`'s read of one blob file, on the event loop: only if nothing in it waits for the
    disk (the path resolved from cached directory entries, every page cached) and its fast
    checksum is recorded (a digest check is too long for the loop). None otherwise, and for
    anything not plainly right (gone, wrong size or checksum, an error): `read_many` reads it
    again in the workers and reports what it finds. The checksum xattr is kept in the inode (ext4,
    XFS); a kernel that dropped the inode's block under memory pressure reads it on the loop."""
    fd = pagecache.open_cached(path)
    if fd is None:
        return None
    try:
        size = digest.size_bytes
        recorded = fileops.recorded_sum(fd)
        if recorded is None or os.fstat(fd).st_size != size:
            return None
        if not pagecache.holds_whole(fd, size):
            return None
        data = os.read(fd, size)
        return data if len(data) == size and fastsum.of(data) == recorded else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _verified(fd: int, data: bytes, digest: Digest) -> bool:
    """Whether the whole content `data` of the open blob file `fd` is right (`Check` in one step)."""
    check = Check(digest)
    check.start(fd)
    check.update(data)
    return check.finish(fd)


def _read_rest(fd: int, wanted: int) -> bytes:
    parts = []
    while wanted > 0:
        chunk = os.read(fd, wanted)
        if not chunk:
            break
        parts.append(chunk)
        wanted -= len(chunk)
    return b"".join(parts)


def read_file(path: str) -> bytes | None:
    """A whole file (an action entry), or None if it is not there."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def open_range(
    path: str, size: int, offset: int, length: int, end: int, check: Check | None
) -> tuple[int, int | None, bytes]:
    """Open, check the size, read the first chunk (fed to `check`, when the whole blob is being
    verified; finished if that was all), all in one hop; keep the fd only if more remains."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return MISSING, None, b""
    try:
        if os.fstat(fd).st_size != size:
            os.close(fd)
            return DAMAGED, None, b""
        data = os.pread(fd, length, offset) if length else b""
        if check is not None:
            check.start(fd)
            _fed(data, fd, check, offset + len(data) >= end)
    except BaseException:
        os.close(fd)
        raise
    if len(data) < length or offset + length >= end:
        os.close(fd)
        return OK, None, data
    # The rest is read in order: a doubled read-ahead window reads a blob that is not in the page
    # cache about twice as fast here (bench/RESULTS.md, "Write behind"). Advice only.
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return OK, fd, data


def pread_checked(fd: int, length: int, offset: int, check: Check | None, last: bool) -> bytes:
    """The next chunk of a streamed read, fed to `check` in the same worker hop (finished after the last)."""
    return _fed(os.pread(fd, length, offset), fd, check, last)


def pread_cached(
    fd: int, length: int, offset: int, cached: pagecache.Residency, check: Check | None, last: bool
) -> bytes | None:
    """`pread_checked` on the event loop: the chunk if the page cache holds all of it (`cached`
    says so just before the read); None if it does not, or on any error or short read (the
    worker's read of the same chunk then reports it)."""
    if not cached.holds(offset, length):
        return None
    try:
        data = os.pread(fd, length, offset)
    except OSError:
        return None
    if len(data) != length:
        return None
    return _fed(data, fd, check, last)


def _fed(data: bytes, fd: int, check: Check | None, last: bool) -> bytes:
    """`data`, a streamed read's next chunk, fed to `check` (finished after the last chunk)."""
    if check is not None:
        check.update(data)
        if last:
            check.finish(fd)
    return data


def stat_size(path: str) -> int | None:
    """A file's size, or None if it is not there."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def close_opened(cf: concurrent.futures.Future[Any]) -> None:
    """Done-callback for an open_range that finished after its caller was cancelled: close the fd."""
    if not cf.cancelled() and cf.exception() is None:
        fd = cf.result()[1]
        if fd is not None:
            os.close(fd)
