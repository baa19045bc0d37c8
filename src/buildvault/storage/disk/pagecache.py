"""What the event loop may read without waiting for the disk: whether the page cache holds a
range of an open file (`Residency`, for a stream's many questions; `holds_whole`, for one), and a
file opened only if its path resolves from cached directory entries (`open_cached`).

Residency asks mincore(2) over a mapping of the file made with no access (PROT_NONE). Nothing
ever touches the mapping, so it can neither fault nor raise SIGBUS; it only names the file's
pages to the kernel. A streamed read asks this before `os.pread` on the event loop. The
alternative that never waits for the disk, a read with RWF_NOWAIT, needs a buffer to read into,
and the bytes a read hands out are then one more copy (64 MiB read: 4.5 ms of the server's 40
ms). Here the check and the read are two calls: a page the kernel drops between them (memory
pressure, microseconds) is read from the disk on the loop.

The kernel answers for a file this process owns or may write (Linux `can_do_mincore`), which
is every file the store wrote; for any other it may say "not cached", and the read goes to the
worker threads.

holds_whole asks cachestat(2) (Linux 6.5), one call where a Residency makes three (mmap, mincore,
munmap): a blob kept as chunks asks once per chunk file, and a 64 MiB one has about 128 of them.
Where cachestat is refused (an older kernel, a seccomp filter) it asks a Residency once.

open_cached is openat2(2) with RESOLVE_CACHED (Linux 5.12): the kernel fails the open with
EAGAIN rather than read a directory from the disk. Python has no binding for openat2; where
the kernel (or a seccomp filter) refuses the call, nothing is opened on the loop.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys

PAGE = mmap.PAGESIZE
_PROT_NONE = 0  # <sys/mman.h>; Python's mmap module names only PROT_READ, PROT_WRITE, PROT_EXEC
_MAP_FAILED = ctypes.c_void_p(-1).value
# Each byte mincore writes says one page; only its lowest bit is defined: set when cached.
_LOWEST_BIT = bytes(i & 1 for i in range(256))


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.restype = ctypes.c_int
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.syscall.restype = ctypes.c_long  # openat2 (open_cached), cachestat (holds_whole): typed at each call
    return libc


_LIBC = _libc()
AVAILABLE = _LIBC is not None


class _OpenHow(ctypes.Structure):
    """struct open_how, <linux/openat2.h>."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = 437  # the same on every Linux architecture (numbers from 424 on are shared)
_RESOLVE_CACHED = 0x20
_AT_FDCWD = -100
_open_cached_works = AVAILABLE
_READ_ONLY_CACHED = _OpenHow(os.O_RDONLY | os.O_CLOEXEC, 0, _RESOLVE_CACHED)


def open_cached(path: str) -> int | None:
    """`path` opened read-only if the kernel resolves it from cached directory entries alone; None
    if that would need the disk, the file is not there, or openat2 is refused here."""
    global _open_cached_works
    if not _open_cached_works or _LIBC is None:
        return None
    how = _READ_ONLY_CACHED
    fd = _LIBC.syscall(
        _SYS_OPENAT2,
        ctypes.c_long(_AT_FDCWD),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.c_void_p(ctypes.addressof(how)),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd >= 0:
        return int(fd)
    if ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.EPERM):  # an older kernel, or a filter
        _open_cached_works = False
    return None


class _CachestatRange(ctypes.Structure):
    """struct cachestat_range, <linux/mman.h>."""

    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    """struct cachestat, <linux/mman.h>: pages of the range cached, dirty, under writeback, evicted."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_SYS_CACHESTAT = 451  # shared by every Linux architecture, like openat2's
_cachestat_works = AVAILABLE


def holds_whole(fd: int, size: int) -> bool:
    """Whether every page of the first `size` bytes of the open file `fd` is in the page cache now."""
    global _cachestat_works
    if size <= 0 or _LIBC is None:
        return False
    if _cachestat_works:
        where, stat = _CachestatRange(0, size), _Cachestat()
        asked = _LIBC.syscall(
            _SYS_CACHESTAT, ctypes.c_long(fd), ctypes.byref(where), ctypes.byref(stat), ctypes.c_long(0)
        )
        if asked == 0:
            return bool(stat.nr_cache == (size + PAGE - 1) // PAGE)
        if ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM):
            return False
        _cachestat_works = False
    residency = Residency(fd, size)
    try:
        return residency.holds(0, size)
    finally:
        residency.close()


class Residency:
    """The page-cache state of the first `size` bytes of the open file `fd` (the fd may be closed
    afterwards: the mapping keeps the file). `close()` unmaps; a mapping that could not be made
    answers "not cached" to every question."""

    __slots__ = ("_address", "_size", "_vector")

    def __init__(self, fd: int, size: int) -> None:
        self._size = size
        self._address: int | None = None
        self._vector: ctypes.Array[ctypes.c_char] | None = None
        if _LIBC is None or size <= 0:
            return
        address = _LIBC.mmap(None, size, _PROT_NONE, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            return
        self._address = address

    def holds(self, offset: int, length: int) -> bool:
        """Whether every page of [offset, offset + length) is in the page cache now."""
        address = self._address
        if address is None or _LIBC is None or offset < 0 or length <= 0 or offset + length > self._size:
            return False
        start = offset - offset % PAGE
        pages = (offset + length - start + PAGE - 1) // PAGE
        vector = self._vector
        if vector is None or len(vector) < pages:
            vector = self._vector = ctypes.create_string_buffer(pages)
        if _LIBC.mincore(address + start, offset + length - start, vector) != 0:
            return False
        return 0 not in vector.raw[:pages].translate(_LOWEST_BIT)

    def close(self) -> None:
        address, self._address = self._address, None
        if address is not None and _LIBC is not None:
            _LIBC.munmap(address, self._size)

    def __del__(self) -> None:
        self.close()
