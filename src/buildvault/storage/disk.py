"""The local content-addressed store: the fast tier, with one LRU and one size cap for CAS and AC.

Layout under `root` (one process per root, enforced with an flock on root/LOCK):

    cas/<fn>/<hh>/<hash>-<size>                  CAS blobs (fn: sha256 | blake3, hh: first two hex digits)
    ac/<kind>/<instance...>/@<fn>/<hh>/<hash>    action entries; '@' never appears in a namespace
                                                 segment, so no namespace can shadow another's files
    tmp/<random>.tmp                             writes in progress; same filesystem, so publishing is
                                                 one atomic rename; emptied at start-up
    index.lru                                    index snapshot: LRU order, sizes, directory mtimes
                                                 (written by close() and every checkpoint_interval)
    SYNC                                         the last sync point and whether the store was closed
                                                 cleanly (see "durability" below: no fsync per write)

Recency is persisted in the snapshot, not derived from atime/mtime: atime is usually off
(noatime/relatime), and keeping mtime current would cost a metadata write per read. The snapshot
also records each leaf directory's mtime, so start-up lists only directories that changed since
(none after a clean close; after a crash, those written since the last checkpoint). The size is in
CAS file names so those listings rebuild entries without a stat; only files unknown to the
snapshot are stat'ed, to place them by mtime. A crash thus costs the recency of recent reads only.

Index memory: one dict, key = 39 bytes (digest-function byte, raw hash, 6-byte size), value =
the last-access second, an int object shared by every entry touched in the same second. Dict order
is the LRU order (touch = pop and re-insert). That is ~130 bytes per blob, where an OrderedDict
would be ~190. Deleting from the front of a dict leaves holes the next scan walks over, so
eviction frees a little slack (max_size/1024) at a time instead of one blob per write.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno
import fcntl
import itertools
import logging
import os
import re
import secrets
import shutil
import struct
import time
import zlib
from array import array
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from buildvault.digest import Digest, DigestFunction, Hasher, InvalidDigest, new_hasher
from buildvault.storage import (
    CHUNK_SIZE,
    CapacityExceeded,
    DigestMismatch,
    InvalidRange,
    NotFound,
    StorageError,
    StorageFull,
)

__all__ = ["DiskActionStore", "DiskBlobStore", "DiskStats", "DiskStorage", "WRITE_BATCH"]

log = logging.getLogger(__name__)

# Incoming chunks are gathered to this size before one thread hop hashes and writes them:
# Bazel sends 16 KiB ByteStream chunks, and 4,096 hops for a 64 MiB blob would cost more than the I/O.
WRITE_BATCH = 1 << 20
# Blobs and entries up to this size are written and read whole, and their file operations are
# coalesced: every such operation pending when the event loop comes round goes to the worker
# threads in one trip (a BatchUpdateBlobs of 100 blobs is one trip, not 100).
SMALL_OP = WRITE_BATCH
_TRIP_OPS = 128  # operations per coalesced trip, at most
_TRIP_BYTES = 8 << 20  # bytes written per coalesced trip, at most
_OWN_TRIP_BYTES = 256 << 10  # an operation on this many bytes gets a trip of its own (no head-of-line wait)
# Action entries (a few hundred bytes each) recently written or read are also kept in memory,
# up to this many bytes, so a GetActionResult hit makes no trip to the worker threads.
AC_CACHE_BYTES = 4 << 20
# Durability (see "durability" in DiskStorage, docs/architecture.md): writes are acknowledged once renamed into
# place, without an fsync each; every SYNC_INTERVAL seconds, if anything changed, a background
# thread syncs the filesystem and then records the time the sync started in SYNC.
SYNC_INTERVAL = 1.0
# File times come from a coarse kernel clock that may lag the wall clock a little: after an
# unclean shutdown, files changed up to this long before the last sync point are verified too.
SYNC_MARGIN_NS = 2_000_000_000
_SYNC_MAGIC = b"BVSYNC\x00\x01"

_FN_BYTE = {fn: bytes([fn.wire]) for fn in DigestFunction}
_FN_BY_BYTE = {fn.wire: fn for fn in DigestFunction}
_SIZE_BYTES = 6  # 256 TiB: more than any disk cache; keeps a key at 39 bytes (a 72-byte object)
_MAX_BLOB = 1 << (8 * _SIZE_BYTES)
_AC_TAG = ord("A")  # first byte of AC keys; CAS keys start with a digest-function wire number (1 or 9)
_SHARDS = tuple(f"{i:02x}" for i in range(256))
_SHARD_SET = frozenset(_SHARDS)
_SEGMENT = re.compile(r"[A-Za-z0-9_.\-]+")
_SNAPSHOT_MAGIC = b"BVLRU\x00\x00\x02"
# A directory modified this recently when its mtime is read may change again within the same
# filesystem clock tick without its mtime changing: such a directory is rescanned at start-up.
RACY_NS = 1_000_000_000
# Files the snapshot does not know are stat'ed to order them by mtime, up to this many: beyond it
# (a lost snapshot of a big store) a cold stat per file would keep the cache down for minutes.
STAT_ORDER_LIMIT = 100_000
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


@dataclass(frozen=True, slots=True)
class DiskStats:
    """What the metrics endpoint and the /status page show about the disk tier."""

    used_bytes: int
    max_bytes: int
    blob_count: int
    ac_entries: int
    evictions_total: int
    lru_age_seconds: float  # age of the least recently used entry: how long an item survives


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until done (a module function so tests can inject ENOSPC)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # eviction must not fail a write; the file is only leaked
        log.warning("could not delete %s: %s", path, e)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename(tmp: str, final: str) -> None:
    try:
        os.replace(tmp, final)
    except FileNotFoundError:
        if not os.path.exists(tmp):
            raise
        os.makedirs(os.path.dirname(final), exist_ok=True)  # AC dirs are made on demand
        os.replace(tmp, final)


_temp_names = itertools.count()
_TEMP_PREFIX = secrets.token_hex(6)


def _check_hash(data: bytes, digest: Digest) -> None:
    hasher = new_hasher(digest.function)
    hasher.update(data)
    actual = hasher.hexdigest()
    if actual != digest.hash:
        raise DigestMismatch(f"blob {digest}: content hashes to {actual}")


def _write_small(tmp_dir: str, final: str, data: bytes, digest: Digest | None) -> None:
    """One whole small entry: verify (CAS), write a temp file, rename it into place."""
    if digest is not None:
        _check_hash(data, digest)
    tmp = f"{tmp_dir}/{_TEMP_PREFIX}{next(_temp_names)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        _rename(tmp, final)
    except BaseException:
        _unlink_quiet(tmp)
        raise


def _read_small(path: str, size: int, offset: int, end: int) -> tuple[int, bytes]:
    """Bytes [offset, end) of a whole small file whose size must be `size`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _MISSING, b""
    try:
        if os.fstat(fd).st_size != size:
            return _DAMAGED, b""
        return _OK, os.pread(fd, end - offset, offset) if end > offset else b""
    finally:
        os.close(fd)


def _read_many(items: list[tuple[str, int]]) -> list[tuple[int, bytes | OSError]]:
    """Whole small files in one trip: (status, bytes) each, or (-1, the OSError). Three syscalls
    a file: reading one byte more than the size finds a file of the wrong size without a stat."""
    results: list[tuple[int, bytes | OSError]] = []
    append = results.append
    flags = os.O_RDONLY | os.O_CLOEXEC
    for path, size in items:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            append((_MISSING, b""))
            continue
        except OSError as e:
            append((-1, e))
            continue
        try:
            data = os.read(fd, size + 1)
            if len(data) == size:
                append((_OK, data))
            elif len(data) > size:
                append((_DAMAGED, b""))
            else:  # a short read of a regular file is the end of it, unless a signal cut it
                rest = _read_rest(fd, size - len(data) + 1)
                append((_OK, data + rest) if len(data) + len(rest) == size else (_DAMAGED, b""))
        except OSError as e:
            append((-1, e))
        finally:
            os.close(fd)
    return results


def _read_rest(fd: int, wanted: int) -> bytes:
    parts = []
    while wanted > 0:
        chunk = os.read(fd, wanted)
        if not chunk:
            break
        parts.append(chunk)
        wanted -= len(chunk)
    return b"".join(parts)


def _write_many(items: list[tuple[str, str, bytes, Digest | None]]) -> list[Exception | None]:
    """_write_small for each item, in one trip: None or the exception, each."""
    results: list[Exception | None] = []
    for item in items:
        try:
            _write_small(*item)
            results.append(None)
        except Exception as e:  # noqa: BLE001 - that item's outcome
            results.append(e)
    return results


def _run_ops(ops: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]]) -> list[tuple[bool, Any]]:
    """A coalesced trip: run each operation, keeping its result or its exception."""
    results: list[tuple[bool, Any]] = []
    for fn, args, _future in ops:
        try:
            results.append((True, fn(*args)))
        except Exception as e:  # noqa: BLE001 - delivered to that operation's caller
            results.append((False, e))
    return results


class _Coalescer:
    """Small file operations queued on the event loop, run in batches in the worker threads.

    Each `submit` returns an asyncio future. The first operation queued in a loop iteration
    schedules a flush for the next one; whatever is queued by then (up to _TRIP_OPS operations
    or _TRIP_BYTES bytes per trip) goes to the pool as one work item, and its results come
    back in one loop wakeup. Operations of one trip run in order; trips run concurrently. An
    operation on _OWN_TRIP_BYTES or more (a whole batch, a large blob) goes at once, in a trip of
    its own, so small ones never wait behind it.
    """

    __slots__ = ("_executor", "_pending", "_bytes")

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self._executor = executor
        self._pending: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
        self._bytes = 0

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], nbytes: int = 0) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if nbytes >= _OWN_TRIP_BYTES:  # hashing and writing it takes a while: others need not wait for it
            self._run([(fn, args, future)], loop)
            return future
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((fn, args, future))
        self._bytes += nbytes
        if len(self._pending) >= _TRIP_OPS or self._bytes >= _TRIP_BYTES:
            self._flush()
        return future

    def _flush(self) -> None:
        ops, self._pending, self._bytes = self._pending, [], 0
        if ops:
            self._run(ops, asyncio.get_running_loop())

    def _run(self, ops: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]], loop: asyncio.AbstractEventLoop) -> None:
        try:
            cf = self._executor.submit(_run_ops, ops)
        except RuntimeError as e:  # the pool is shut down: the store is closing
            for _fn, _args, future in ops:
                if not future.done():
                    future.set_exception(StorageError(f"disk store is closed ({e})"))
            return
        cf.add_done_callback(lambda cf: loop.call_soon_threadsafe(_deliver, ops, cf))


def _deliver(ops: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]], cf: concurrent.futures.Future[Any]) -> None:
    try:
        results = cf.result()
    except BaseException as e:  # noqa: BLE001 - _run_ops itself failed (MemoryError...)
        results = [(False, e)] * len(ops)
    for (_fn, _args, future), (ok, value) in zip(ops, results):
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


_libc: Any = None


def _syncfs(fd: int) -> None:
    """Flush every dirty page and inode of the filesystem holding `fd` (os.sync where syncfs is missing)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.syncfs.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if _libc is False:
        os.sync()
        return
    if _libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def _verify_entry(path: str, key: bytes) -> bool:
    """Is this file what its name says? CAS: size and hash; AC: a readable entry (see _check_ac)."""
    if key[0] == _AC_TAG:
        with open(path, "rb") as f:
            return _check_ac(key, f.read())
    size = int.from_bytes(key[33:], "big")
    hasher = new_hasher(_FN_BY_BYTE[key[0]])
    total = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK_SIZE):
            total += len(chunk)
            if total > size:
                return False
            hasher.update(chunk)
    return total == size and hasher.hexdigest() == key[1:33].hex()


def _check_ac(key: bytes, data: bytes) -> bool:
    """An AC entry that survived a power loss: not empty, not zero-filled, and an ActionResult
    that parses where the namespace's kind is `ac` (kind `raw` entries are opaque)."""
    if not data or not data.strip(b"\x00"):
        return False
    namespace = key[1 : key.index(b"\x00")].decode()
    if namespace.split("/", 1)[0] != "ac":
        return True
    from google.protobuf.message import DecodeError

    from buildvault.remote_apis import re_pb2

    try:
        re_pb2.ActionResult.FromString(data)
    except DecodeError:
        return False
    return True


_OK, _MISSING, _DAMAGED = range(3)


def _open_range(path: str, size: int, offset: int, length: int, end: int) -> tuple[int, int | None, bytes]:
    """Open, check the size, read the first chunk, all in one hop; keep the fd only if more remains."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _MISSING, None, b""
    try:
        if os.fstat(fd).st_size != size:
            os.close(fd)
            return _DAMAGED, None, b""
        data = os.pread(fd, length, offset) if length else b""
    except BaseException:
        os.close(fd)
        raise
    if len(data) < length or offset + length >= end:
        os.close(fd)
        return _OK, None, data
    return _OK, fd, data


def _sizes_named(directory: str, hex_hash: str) -> list[int]:
    """Sizes in the `<hash>-<size>` names of one CAS shard directory for this hash."""
    prefix = hex_hash + "-"
    sizes = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith(prefix):
            try:
                sizes.append(int(name[len(prefix) :]))
            except ValueError:
                pass
    return sizes


async def _single(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _close_opened(cf: concurrent.futures.Future[Any]) -> None:
    """Done-callback for an open that finished after its caller was cancelled: close the fd."""
    if not cf.cancelled() and cf.exception() is None:
        fd = cf.result()[1]
        if fd is not None:
            os.close(fd)


def _storage_error(e: OSError, what: str) -> StorageError:
    if e.errno in _NO_SPACE:
        return StorageFull(f"{what}: {os.strerror(e.errno)}")
    return StorageError(f"{what}: {e}")


def _check_namespace(namespace: str) -> None:
    for segment in namespace.split("/"):
        if segment in (".", "..") or not _SEGMENT.fullmatch(segment):
            raise InvalidDigest(f"invalid action namespace {namespace[:100]!r}")


def _cas_key(digest: Digest) -> bytes:
    """Index key: function byte + raw hash + size. Raises InvalidDigest for a malformed hash."""
    try:
        raw = bytes.fromhex(digest.hash)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 32 or not 0 <= digest.size_bytes < _MAX_BLOB:
        raise InvalidDigest(f"invalid digest {digest}")
    return _FN_BYTE[digest.function] + raw + digest.size_bytes.to_bytes(_SIZE_BYTES, "big")


def _dir_id(key: bytes) -> bytes:
    """The leaf directory of an entry: function byte + first hash byte (CAS), or AC prefix + first hash byte."""
    return key[:2] if key[0] != _AC_TAG else key[:-31]


def _scan_cas_dir(path: str, fn_byte: bytes, shard: str) -> tuple[list[tuple[bytes, int, str]], int]:
    """Parse `<hash>-<size>` names: (key, size, name) for each entry, and the count of stray files."""
    found = []
    strays = 0
    for name in os.listdir(path):
        hex_hash, _, size_text = name.partition("-")
        try:
            raw = bytes.fromhex(hex_hash)
            size = int(size_text)
        except ValueError:
            strays += 1
            continue
        canonical = raw.hex() == hex_hash and str(size) == size_text
        if len(raw) != 32 or not canonical or not hex_hash.startswith(shard) or size >= _MAX_BLOB:
            strays += 1
            continue
        found.append((fn_byte + raw + size.to_bytes(_SIZE_BYTES, "big"), size, name))
    return found, strays


def _scan_ac_dir(path: str, prefix: bytes) -> tuple[list[tuple[bytes, int, str]], int]:
    """Parse `<hash>` names of one AC leaf directory (sizes need a stat: entries are replaced in place)."""
    shard = os.path.basename(path)
    found = []
    strays = 0
    for name in os.listdir(path):
        try:
            raw = bytes.fromhex(name)
        except ValueError:
            raw = b""
        if len(raw) != 32 or raw.hex() != name or not name.startswith(shard):
            strays += 1
            continue
        found.append((prefix + raw, os.stat(path + "/" + name).st_size, name))
    return found, strays


def _byte_strings(items: list[bytes]) -> tuple[bytes, bytes, bytes]:
    """Snapshot encoding of a list of short byte strings: count, u16 lengths, concatenation."""
    return len(items).to_bytes(8, "little"), array("H", map(len, items)).tobytes(), b"".join(items)


class _Reader:
    """Decodes what _write_snapshot wrote; any inconsistency raises ValueError."""

    def __init__(self, data: bytes, offset: int) -> None:
        self.data = data
        self.offset = offset

    def _take(self, size: int) -> bytes:
        chunk = self.data[self.offset : self.offset + size]
        if len(chunk) != size:
            raise ValueError("truncated")
        self.offset += size
        return chunk

    def number(self) -> int:
        return int.from_bytes(self._take(8), "little")

    def numbers(self, code: str, count: int) -> array[int]:
        values = array(code)
        values.frombytes(self._take(values.itemsize * count))
        return values

    def byte_strings(self) -> list[bytes]:
        count = self.number()
        lens = self.numbers("H", count)
        blob = self._take(sum(lens))
        return [blob[end - length : end] for end, length in zip(accumulate(lens), lens)]


class _TempFile:
    """A write in progress. Its methods run in worker threads, one at a time."""

    __slots__ = ("directory", "path", "fd", "hasher")

    def __init__(self, directory: str, hasher: Hasher | None) -> None:
        self.directory = directory
        self.path: str | None = None
        self.fd: int | None = None
        self.hasher = hasher

    def write(self, parts: list[bytes]) -> None:
        data = self.digest_part(parts)
        self.append(data)

    def digest_part(self, parts: list[bytes]) -> bytes:
        """Join and hash the next part (never touches the file: may run beside `append`)."""
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if self.hasher is not None and data:
            self.hasher.update(data)
        return data

    def append(self, data: bytes) -> None:
        """Write the next part (never touches the hasher: may run beside `digest_part`)."""
        if self.fd is None:
            path = os.path.join(self.directory, secrets.token_hex(12) + ".tmp")
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            self.path = path
        if data:
            _write_all(self.fd, data)

    def finish(self, parts: list[bytes], sync: bool = False) -> str | None:
        """Write the rest, close (fsync first if `sync`); return the hex digest."""
        self.write(parts)
        assert self.fd is not None
        if sync:
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        return self.hasher.hexdigest() if self.hasher is not None else None

    def abort(self, *pending: concurrent.futures.Future[Any] | None) -> None:
        """Remove the temp file; first wait for work still running on it, so the fd is never reused."""
        running = [cf for cf in pending if cf is not None]
        if running:
            concurrent.futures.wait(running)
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        if self.path is not None:
            _unlink_quiet(self.path)
            self.path = None


class _Reservation:
    """Bytes promised to one write. Publishing turns them into used bytes in the same step, so
    `used + reserved` never counts a blob twice; release() is idempotent for every other exit."""

    __slots__ = ("storage", "size")

    def __init__(self, storage: DiskStorage, size: int) -> None:
        self.storage = storage
        self.size = size
        storage._reserved += size

    def release(self) -> None:
        self.storage._reserved -= self.size
        self.size = 0


class _FileChunks:
    """Chunks of [offset, end) of an open file, one chunk read ahead so disk and consumer overlap.

    Holding the fd is what keeps an evicted (unlinked) blob readable. The fd is closed at the end,
    on aclose(), or when the iterator is collected; never while a read on it is still running.
    """

    def __init__(
        self, executor: concurrent.futures.Executor, fd: int | None, first: bytes, pos: int, end: int, what: str
    ) -> None:
        self._executor = executor
        self._fd = fd
        self._first: bytes | None = first
        self._pos = pos
        self._end = end
        self._what = what
        self._ahead: concurrent.futures.Future[bytes] | None = None
        self._ahead_len = 0

    def __aiter__(self) -> _FileChunks:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            data, self._first = self._first, None
            self._read_ahead()
            if data:
                return data
        cf = self._ahead
        if cf is None:
            self._close()
            raise StopAsyncIteration
        try:
            data = await asyncio.wrap_future(cf)
        except BaseException as e:
            self._close()
            if isinstance(e, OSError):
                raise _storage_error(e, f"reading {self._what}") from e
            raise
        self._ahead = None
        if len(data) != self._ahead_len:
            self._close()
            raise StorageError(f"{self._what} is shorter on disk than its size")
        self._pos += len(data)
        self._read_ahead()
        return data

    def _read_ahead(self) -> None:
        if self._fd is not None and self._pos < self._end:
            self._ahead_len = min(CHUNK_SIZE, self._end - self._pos)
            self._ahead = self._executor.submit(os.pread, self._fd, self._ahead_len, self._pos)
        else:
            self._close()

    def _close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is None:
            return
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.cancel() and not ahead.done():
            ahead.add_done_callback(lambda _f: os.close(fd))
        else:
            os.close(fd)

    async def aclose(self) -> None:
        self._close()

    def __del__(self) -> None:
        self._close()


class _WholeChunks:
    """The bytes of a small read, as the one-chunk iterator `read` returns (chunks of at most CHUNK_SIZE)."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> _WholeChunks:
        return self

    async def __anext__(self) -> bytes:
        data = self._data
        if not data:
            self._data = None
            raise StopAsyncIteration
        if len(data) <= CHUNK_SIZE:
            self._data = None
            return data
        self._data = data[CHUNK_SIZE:]
        return data[:CHUNK_SIZE]

    async def aclose(self) -> None:
        self._data = None


class DiskStorage:
    """The shared engine: layout, index, space accounting, LRU, thread pool. Use `await DiskStorage.open()`."""

    def __init__(
        self,
        root: Path | str,
        max_size: int,
        *,
        checkpoint_interval: float | None = 600.0,
        max_workers: int | None = None,
        sync_interval: float | None = SYNC_INTERVAL,
    ) -> None:
        self.root = Path(root)
        self.max_size = max_size
        self.checkpoint_interval = checkpoint_interval
        self.sync_interval = sync_interval
        self._sync_path = str(self.root / "SYNC")
        self._cas_dir = str(self.root / "cas")
        self._ac_dir = str(self.root / "ac")
        self._tmp_dir = str(self.root / "tmp")
        self._snapshot_path = str(self.root / "index.lru")
        # Evicting a little more than needed keeps front-of-dict scans rare (see module docstring).
        self._slack = min(max_size // 1024, 64 << 20)
        workers = max_workers or min(32, (os.cpu_count() or 1) + 4)
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="buildvault-disk")
        self._ops = _Coalescer(self._executor)
        # syncfs can take seconds under heavy writes: it gets its own thread, never the pool's.
        self._sync_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="buildvault-sync")
        self._unsynced = False  # something was published or deleted since the last sync point
        self._syncer: asyncio.Task[None] | None = None
        self._index: dict[bytes, int] = {}  # key -> last access (unix seconds); order = LRU order
        self._ac_sizes: dict[bytes, int] = {}  # AC sizes are not in their keys (entries get replaced)
        self._used = 0  # bytes of published entries
        self._reserved = 0  # bytes promised to writes in progress
        self._evictions = 0
        self._tick = int(time.time())
        self._publishing: dict[bytes, asyncio.Future[None]] = {}
        self._deleting: dict[bytes, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self._namespaces: dict[str, bytes] = {}  # validated namespace -> key prefix
        self._sizes: dict[bytes, int] = {}  # recent hash-only lookups: function byte + raw hash -> size
        self._ac_cache: dict[bytes, bytes] = {}  # AC key -> entry, oldest first (see AC_CACHE_BYTES)
        self._ac_cache_bytes = 0
        self._ac_published = 0  # AC publishes so far: a read that raced one is not cached
        self._lock_fd: int | None = None
        self._tracking: set[bytes] | None = None  # dirs whose index entries changed during a checkpoint
        self._closing = False
        self._checkpointer: asyncio.Task[None] | None = None
        self._closed = False
        self.load_info: dict[str, Any] = {}
        self.cas = DiskBlobStore(self)
        self.ac = DiskActionStore(self)

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        root: Path | str,
        max_size: int,
        *,
        checkpoint_interval: float | None = 600.0,
        max_workers: int | None = None,
        sync_interval: float | None = SYNC_INTERVAL,
    ) -> DiskStorage:
        """Lock `root`, clear leftover temp files and rebuild the index, all off the event loop.

        After an unclean shutdown, entries changed since the last sync point are verified first.
        """
        storage = cls(
            root, max_size, checkpoint_interval=checkpoint_interval, max_workers=max_workers, sync_interval=sync_interval
        )
        try:
            index, ac_sizes, used = await storage._io(storage._load, what=f"opening {root}")
        except BaseException:
            storage._executor.shutdown(wait=False)
            storage._sync_executor.shutdown(wait=False)
            if storage._lock_fd is not None:
                os.close(storage._lock_fd)
                storage._lock_fd = None
            raise
        storage._index, storage._ac_sizes, storage._used = index, ac_sizes, used
        if used > max_size:  # the cap was lowered since the last run
            await storage._settle_all(storage._evict(used - max_size))
        if checkpoint_interval:
            storage._checkpointer = asyncio.create_task(storage._checkpoint_loop(checkpoint_interval))
        if sync_interval:
            storage._syncer = asyncio.create_task(storage._sync_loop(sync_interval))
        return storage

    async def close(self) -> None:
        """Refuse new work, finish publishes and deletions, write the snapshot, release the directory.

        Call it once the servers have stopped: a write still streaming may fail (its temp file is
        removed at the next start).
        """
        if self._closing:
            return
        self._closing = True
        try:
            for task in (self._checkpointer, self._syncer):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            await asyncio.gather(
                *self._tasks, *self._publishing.values(), *self._deleting.values(), return_exceptions=True
            )
            try:
                await self.checkpoint(_quiesced=True)
            except StorageError as e:
                log.warning("could not write the index snapshot: %s", e)
            try:
                # Everything is on disk: the next start needs to verify nothing.
                await asyncio.wrap_future(self._sync_executor.submit(self._sync_and_mark, time.time_ns(), True))
            except OSError as e:
                log.warning("could not record the clean shutdown: %s", e)
        finally:
            self._closed = True
            await asyncio.get_running_loop().run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
        self._executor.shutdown(wait=True)
        self._sync_executor.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def __aenter__(self) -> DiskStorage:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- snapshot and start-up ---------------------------------------------------------------
    #
    # The snapshot holds the index (keys in LRU order, access seconds, AC sizes, used bytes) and
    # the mtime of every leaf directory (cas/<fn>/<hh>, ac/.../@<fn>/<hh>) at the time it was
    # taken. Creating, renaming or deleting a file changes its directory's mtime, so at start-up
    # a directory whose mtime still matches is known to hold exactly the snapshot's entries: it is
    # not listed at all. Only directories that changed (after a crash: those written since the
    # last checkpoint) are listed, and only files the snapshot does not know are stat'ed. Like
    # git's "racily clean" index entries, a directory modified within RACY_NS of the moment its
    # mtime was read is never trusted, since a later change in the same clock tick would not show.

    async def checkpoint(self, *, _quiesced: bool = False) -> None:
        """Persist the index and LRU order (copying the keys is the only event-loop work)."""
        if self._closed:
            raise StorageError("disk store is closed")
        while self._tracking is not None:  # one checkpoint at a time
            await asyncio.sleep(0.01)
        keys, ticks = list(self._index), list(self._index.values())
        ac_sizes, used = list(self._ac_sizes.items()), self._used
        dirty = self._dirs_in_flight()
        self._tracking = dirty  # index changes from now until the directories are stat'ed
        try:
            dirs = await self._io(self._leaf_dirs, 0 if _quiesced else RACY_NS, what="reading directory times")
        finally:
            self._tracking = None
        dirty |= self._dirs_in_flight()
        recorded = {dir_id: -1 if dir_id in dirty else mtime for dir_id, (_path, mtime) in dirs.items()}
        await self._io(self._write_snapshot, keys, ticks, ac_sizes, used, recorded, what="writing the LRU snapshot")

    def _dirs_in_flight(self) -> set[bytes]:
        """Directories with a rename or unlink under way: their mtime says nothing yet."""
        return {_dir_id(key) for key in (*self._publishing, *self._deleting)}

    async def _checkpoint_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.checkpoint()
            except StorageError as e:
                log.warning("could not write the LRU snapshot: %s", e)

    # -- durability ----------------------------------------------------------------------------
    #
    # A write is acknowledged once its verified temp file is renamed into place: no fsync per
    # entry (1-3 ms each on common disks). A killed process loses nothing (the page cache has
    # it); an OS crash or power loss may lose or tear what was written since the last sync point.
    # The syncer (its own thread) calls syncfs every sync_interval seconds when anything changed,
    # then records in SYNC the time at which that sync started: every file changed before it is
    # on disk. SYNC also says whether the store was closed cleanly. Start-up after an unclean
    # shutdown verifies every entry changed (ctime) since the last sync point, minus a margin,
    # and deletes those that are wrong, so a torn or zero-filled file is never served.

    async def sync(self) -> None:
        """Make every write acknowledged so far durable, and record the sync point."""
        if self._closed:
            raise StorageError("disk store is closed")
        self._unsynced = False
        started = time.time_ns()
        try:
            await asyncio.shield(asyncio.wrap_future(self._sync_executor.submit(self._sync_and_mark, started, False)))
        except OSError as e:
            self._unsynced = True
            raise _storage_error(e, "syncing the disk store") from e

    async def _sync_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if self._unsynced:
                try:
                    await self.sync()
                except StorageError as e:
                    log.warning("could not sync the disk store: %s", e)

    def _sync_and_mark(self, started_ns: int, clean: bool) -> None:
        """syncfs, then durably record `started_ns` (and whether this is a clean close) in SYNC."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _syncfs(fd)
        finally:
            os.close(fd)
        body = _SYNC_MAGIC + bytes([clean]) + started_ns.to_bytes(8, "little")
        tmp = _TempFile(self._tmp_dir, None)
        try:
            tmp.finish([body, zlib.crc32(body).to_bytes(4, "little")], sync=True)
            assert tmp.path is not None
            os.replace(tmp.path, self._sync_path)
            tmp.path = None
            _fsync_dir(str(self.root))
        finally:
            tmp.abort(None)

    def _read_sync_marker(self) -> tuple[bool, int] | None:
        """(clean, sync point in ns) from SYNC; None if there is none (a new store, or one made
        before sync points existed, when every write was fsync'ed)."""
        try:
            with open(self._sync_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        body = data[:-4]
        if len(data) != len(_SYNC_MAGIC) + 13 or not data.startswith(_SYNC_MAGIC) or zlib.crc32(body) != int.from_bytes(data[-4:], "little"):
            log.warning("%s is damaged: verifying every entry", self._sync_path)
            return False, 0
        return bool(body[len(_SYNC_MAGIC)]), int.from_bytes(body[-8:], "little")

    def _verify_since(self, dirs: dict[bytes, tuple[str, int]], since_ns: int) -> tuple[int, int]:
        """Verify the entries changed at or after `since_ns` in directories changed since then;
        delete the bad ones. Returns (entries verified, entries deleted)."""
        checked = removed = 0
        for dir_id, (path, mtime) in dirs.items():
            if 0 <= mtime < since_ns:
                continue  # no entry was created, replaced or removed in it since
            try:
                entries = list(os.scandir(path))
            except FileNotFoundError:
                continue
            ac = dir_id[0] == _AC_TAG
            for entry in entries:
                try:
                    if entry.stat(follow_symlinks=False).st_ctime_ns < since_ns:
                        continue
                except FileNotFoundError:
                    continue
                if ac:
                    try:
                        raw = bytes.fromhex(entry.name)
                    except ValueError:
                        continue
                    if len(raw) != 32:
                        continue
                    key = dir_id[:-1] + raw
                else:
                    hex_hash, _, size_text = entry.name.partition("-")
                    try:
                        raw = bytes.fromhex(hex_hash)
                        size = int(size_text)
                    except ValueError:
                        continue
                    if len(raw) != 32 or not 0 <= size < _MAX_BLOB:
                        continue
                    key = dir_id[:1] + raw + size.to_bytes(_SIZE_BYTES, "big")
                checked += 1
                try:
                    good = _verify_entry(entry.path, key)
                except OSError as e:
                    log.warning("cannot verify %s (%s): deleting it", entry.path, e)
                    good = False
                if not good:
                    log.error("%s was damaged by an unclean shutdown: deleting it", entry.path)
                    _unlink_quiet(entry.path)
                    removed += 1
        return checked, removed

    def stats(self) -> DiskStats:
        age = 0.0
        if self._index:
            age = max(0.0, time.time() - self._index[next(iter(self._index))])
        return DiskStats(
            used_bytes=self._used,
            max_bytes=self.max_size,
            blob_count=len(self._index) - len(self._ac_sizes),
            ac_entries=len(self._ac_sizes),
            evictions_total=self._evictions,
            lru_age_seconds=age,
        )

    def _leaf_dirs(self, racy_ns: int) -> dict[bytes, tuple[str, int]]:
        """Every leaf directory as dir id -> (path, mtime_ns); -1 when modified too recently to trust.

        Creates missing CAS shard directories. Lists only the upper AC levels, never leaf contents.
        """
        now = time.time_ns()
        dirs: dict[bytes, tuple[str, int]] = {}

        def add(dir_id: bytes, path: str) -> None:
            mtime = os.stat(path).st_mtime_ns
            dirs[dir_id] = (path, -1 if mtime > now - racy_ns else mtime)

        for fn in DigestFunction:
            base = os.path.join(self._cas_dir, fn.label)
            for shard in _SHARDS:
                path = base + "/" + shard
                try:
                    add(_FN_BYTE[fn] + bytes.fromhex(shard), path)
                except FileNotFoundError:
                    os.makedirs(path, exist_ok=True)
                    add(_FN_BYTE[fn] + bytes.fromhex(shard), path)

        def walk(path: str, segments: list[str]) -> None:
            with os.scandir(path) as entries:
                children = [entry for entry in entries if entry.is_dir(follow_symlinks=False)]
            for child in children:
                if child.name.startswith("@") and segments:
                    try:
                        fn_byte = _FN_BYTE[DigestFunction.from_label(child.name[1:])]
                    except InvalidDigest:
                        continue
                    prefix = b"A" + "/".join(segments).encode() + b"\x00" + fn_byte
                    with os.scandir(child.path) as shards:
                        for shard in shards:
                            if shard.name in _SHARD_SET and shard.is_dir(follow_symlinks=False):
                                add(prefix + bytes.fromhex(shard.name), shard.path)
                elif _SEGMENT.fullmatch(child.name) and child.name not in (".", ".."):
                    walk(child.path, [*segments, child.name])

        walk(self._ac_dir, [])
        return dirs

    def _load(self) -> tuple[dict[bytes, int], dict[bytes, int], int]:
        """Lock, clear tmp/, rebuild the index from the snapshot plus the directories that changed."""
        started = time.perf_counter()
        for directory in (self.root, self._cas_dir, self._ac_dir, self._tmp_dir):
            os.makedirs(directory, exist_ok=True)
        self._lock_fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise StorageError(f"{self.root} is in use by another buildvault process") from None
        stale = 0
        for entry in os.scandir(self._tmp_dir):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                _unlink_quiet(entry.path)
            stale += 1

        dirs = self._leaf_dirs(0)
        marker = self._read_sync_marker()
        verified = damaged = 0
        if marker is not None and not marker[0]:
            verified, damaged = self._verify_since(dirs, marker[1] - SYNC_MARGIN_NS)
            if damaged:
                dirs = self._leaf_dirs(0)
        interned: dict[int, int] = {}
        index: dict[bytes, int] = {}
        ac_sizes: dict[bytes, int] = {}
        used = 0
        snapshot = self._read_snapshot()
        if snapshot is not None:
            keys, ticks, ac_pairs, used, recorded = snapshot
            index = dict(zip(keys, map(interned.setdefault, ticks, ticks)))
            ac_sizes = dict(ac_pairs)
            del keys, ticks, ac_pairs
            trusted = {d for d, (_path, mtime) in dirs.items() if mtime != -1 and recorded.get(d) == mtime}
            fast = len(trusted) == len(dirs) and recorded.keys() <= dirs.keys()
        else:
            trusted, fast = set(), False
        from_snapshot = len(index)
        extras: list[tuple[bytes, int, str]] = []  # (key, size, path): on disk, not in the snapshot
        strays = stat_calls = 0
        scanned = [d for d in dirs if d not in trusted]
        if not fast:
            # Entries of untrusted directories stay in place (keeping their LRU position) only if found.
            suspects = {key for key in index if (key[:2] if key[0] != _AC_TAG else key[:-31]) not in trusted}
            for dir_id in scanned:
                path = dirs[dir_id][0]
                if dir_id[0] == _AC_TAG:
                    found, bad = _scan_ac_dir(path, dir_id[:-1])
                else:
                    found, bad = _scan_cas_dir(path, dir_id[:1], dir_id[1:].hex())
                strays += bad
                for key, size, name in found:
                    if key in suspects:
                        suspects.discard(key)
                        if key[0] == _AC_TAG:
                            used += size - ac_sizes[key]
                            ac_sizes[key] = size
                    elif key not in index:
                        extras.append((key, size, path + "/" + name))
            for key in suspects:  # in the snapshot, gone from disk
                del index[key]
                used -= ac_sizes.pop(key) if key[0] == _AC_TAG else int.from_bytes(key[33:], "big")
            from_snapshot = len(index)
            if len(extras) <= STAT_ORDER_LIMIT:
                stat_calls = len(extras)
                timed = sorted((os.stat(file).st_mtime_ns, key, size) for key, size, file in extras)
            else:
                log.warning("%s: no usable LRU snapshot for %d files; they start in directory order", self.root, len(extras))
                now_ns = time.time_ns()
                timed = [(now_ns, key, size) for key, size, _file in extras]
            for mtime_ns, key, size in timed:
                tick = mtime_ns // 1_000_000_000
                index[key] = interned.setdefault(tick, tick)
                used += size
                if key[0] == _AC_TAG:
                    ac_sizes[key] = size
        if strays:
            log.warning("%s: ignored %d files that are not store entries", self.root, strays)
        self.load_info = {
            "seconds": time.perf_counter() - started,
            "entries": len(index),
            "from_snapshot": from_snapshot,
            "dirs": len(dirs),
            "scanned_dirs": 0 if fast else len(scanned),
            "stat_calls": stat_calls,
            "stale_temp_files": stale,
            "stray_files": strays,
            "clean_shutdown": marker is None or marker[0],
            "verified": verified,
            "damaged": damaged,
        }
        # What was found is on disk now (a killed process leaves it in the page cache only):
        # the new sync point also says "running", so a crash from here on is unclean.
        self._sync_and_mark(time.time_ns(), False)
        return index, ac_sizes, used

    def _read_snapshot(self) -> tuple[list[bytes], array[int], Iterable[tuple[bytes, int]], int, dict[bytes, int]] | None:
        try:
            with open(self._snapshot_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            if len(data) < 16 or data[:8] != _SNAPSHOT_MAGIC:
                raise ValueError("unknown format")
            if zlib.crc32(memoryview(data)[:-4]) != int.from_bytes(data[-4:], "little"):
                raise ValueError("truncated or corrupt")
            reader = _Reader(data, 8)
            used = reader.number()
            keys = reader.byte_strings()
            ticks = reader.numbers("I", len(keys))
            ac_keys = reader.byte_strings()
            ac_sizes = reader.numbers("Q", len(ac_keys))
            dir_ids = reader.byte_strings()
            mtimes = reader.numbers("q", len(dir_ids))
            if reader.offset != len(data) - 4:
                raise ValueError("trailing bytes")
            return keys, ticks, zip(ac_keys, ac_sizes), used, dict(zip(dir_ids, mtimes))
        except (ValueError, struct.error, IndexError) as e:
            log.warning("ignoring LRU snapshot %s (%s): rescanning the store", self._snapshot_path, e)
            return None

    def _write_snapshot(
        self, keys: list[bytes], ticks: list[int], ac_sizes: list[tuple[bytes, int]], used: int, dirs: dict[bytes, int]
    ) -> None:
        ac_keys = [key for key, _size in ac_sizes]
        parts = [
            _SNAPSHOT_MAGIC,
            used.to_bytes(8, "little"),
            *_byte_strings(keys),
            array("I", ticks).tobytes(),
            *_byte_strings(ac_keys),
            array("Q", [size for _key, size in ac_sizes]).tobytes(),
            *_byte_strings(list(dirs)),
            array("q", dirs.values()).tobytes(),
        ]
        body = b"".join(parts)
        tmp = _TempFile(self._tmp_dir, None)
        try:
            tmp.finish([body, zlib.crc32(body).to_bytes(4, "little")], sync=True)
            assert tmp.path is not None
            os.replace(tmp.path, self._snapshot_path)
            tmp.path = None
            _fsync_dir(str(self.root))
        finally:
            tmp.abort(None)

    # -- plumbing --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise StorageError("disk store is closed")

    async def _io(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        """Run blocking file work in the store's pool; OSErrors become storage errors."""
        try:
            return await asyncio.wrap_future(self._executor.submit(fn, *args))
        except OSError as e:
            raise _storage_error(e, what) from e

    async def _settle(self, cf: concurrent.futures.Future[Any]) -> None:
        """Wait for cleanup that must finish even if the caller is cancelled meanwhile."""
        await asyncio.shield(asyncio.wrap_future(cf))

    async def _settle_all(self, futures: list[asyncio.Future[None]]) -> None:
        if futures:
            await asyncio.shield(asyncio.gather(*futures, return_exceptions=True))

    def _now(self) -> int:
        """Current second, as one int object shared by all entries touched within it."""
        now = int(time.time())
        if now != self._tick:
            self._tick = now
        return self._tick

    def _touch(self, key: bytes) -> None:
        index = self._index
        del index[key]
        index[key] = self._now()

    def _entry_size(self, key: bytes) -> int:
        if key[0] == _AC_TAG:
            return self._ac_sizes[key]
        return int.from_bytes(key[33:], "big")

    def _path(self, key: bytes) -> str:
        if key[0] == _AC_TAG:
            hex_hash = key[-32:].hex()
            namespace = key[1:-34].decode()
            label = _FN_BY_BYTE[key[-33]].label
            return f"{self._ac_dir}/{namespace}/@{label}/{hex_hash[:2]}/{hex_hash}"
        hex_hash = key[1:33].hex()
        size = int.from_bytes(key[33:], "big")
        return f"{self._cas_dir}/{_FN_BY_BYTE[key[0]].label}/{hex_hash[:2]}/{hex_hash}-{size}"

    def _ac_key(self, namespace: str, digest: Digest) -> bytes:
        cached = self._namespaces.get(namespace)
        if cached is None:
            _check_namespace(namespace)
            if len(self._namespaces) > 10_000:
                self._namespaces.clear()
            cached = self._namespaces[namespace] = b"A" + namespace.encode() + b"\x00"
        try:
            raw = bytes.fromhex(digest.hash)
        except (ValueError, TypeError):
            raw = b""
        if len(raw) != 32:
            raise InvalidDigest(f"invalid digest {digest}")
        return cached + _FN_BYTE[digest.function] + raw

    def _forget(self, key: bytes) -> int:
        """Drop an entry from the index and the accounting; return its size."""
        size = self._entry_size(key)
        del self._index[key]
        if self._ac_sizes.pop(key, None) is not None:
            self._uncache(key)
        self._used -= size
        if self._tracking is not None:
            self._tracking.add(_dir_id(key))
        return size

    def _cache(self, key: bytes, data: bytes) -> None:
        """Keep an action entry in memory (first in, first out within AC_CACHE_BYTES)."""
        if len(data) > AC_CACHE_BYTES // 64:
            return
        self._uncache(key)
        cache = self._ac_cache
        cache[key] = data
        self._ac_cache_bytes += len(data)
        while self._ac_cache_bytes > AC_CACHE_BYTES:
            self._uncache(next(iter(cache)))

    def _uncache(self, key: bytes) -> None:
        old = self._ac_cache.pop(key, None)
        if old is not None:
            self._ac_cache_bytes -= len(old)

    def _evict(self, need: int) -> list[asyncio.Future[None]]:
        """Drop least recently used entries until `need` bytes are freed; unlink their files in the pool."""
        victims: list[bytes] = []
        freed = 0
        for key in self._index:
            if freed >= need:
                break
            if key in self._publishing:  # an AC entry being replaced is about to become the newest
                continue
            victims.append(key)
            freed += self._entry_size(key)
        futures = []
        for key in victims:
            self._forget(key)
            futures.append(self._delete_file(key))
        self._evictions += len(victims)
        return futures

    def _delete_file(self, key: bytes) -> asyncio.Future[None]:
        future = self._ops.submit(_unlink_quiet, (self._path(key),))
        self._deleting[key] = future

        def done(f: asyncio.Future[None], key: bytes = key) -> None:
            if self._deleting.get(key) is f:
                del self._deleting[key]

        future.add_done_callback(done)
        return future

    def _drop_missing(self, key: bytes) -> None:
        """The file vanished behind our back (deleted by hand): forget it."""
        if key in self._index and key not in self._publishing:
            log.warning("%s vanished from disk; dropping it from the index", self._path(key))
            self._forget(key)

    async def _reserve(self, size: int, what: object) -> _Reservation:
        """Promise `size` bytes to a write, evicting first, so the total on disk stays under max_size."""
        self._check_open()
        if size > self.max_size:
            raise CapacityExceeded(f"{what} ({size} bytes) is larger than the store's {self.max_size} bytes")
        if self._reserved + size > self.max_size:
            raise StorageFull(f"no room for {what}: writes in progress hold the space")
        deletions: list[asyncio.Future[None]] = []
        over = self._used + self._reserved + size - self.max_size
        if over > 0:
            deletions = self._evict(over + self._slack)
            if self._used + self._reserved + size > self.max_size:
                raise StorageFull(f"no room for {what}: writes in progress hold the space")
        reservation = _Reservation(self, size)
        try:
            await self._settle_all(deletions)  # let the space really be free before writing
        except BaseException:
            reservation.release()
            raise
        return reservation

    async def _receive(self, digest: Digest | None, size: int, chunks: AsyncIterable[bytes] | bytes, what: object) -> str:
        """Stream into a temp file in batches, verifying size and hash; return its path.

        On any failure (mismatch, ENOSPC, an error from the iterator, cancellation) the temp file is
        gone before this returns.
        """
        temp = _TempFile(self._tmp_dir, new_hasher(digest.function) if digest is not None else None)
        # A pipeline of two workers: batch N is hashed while batch N-1 is written (each about
        # as costly as the other), while the event loop receives batch N+1.
        hashed: concurrent.futures.Future[Any] | None = None  # -> the joined bytes of the batch
        written: concurrent.futures.Future[Any] | None = None
        pending: concurrent.futures.Future[Any] | None = None
        try:
            if isinstance(chunks, bytes):
                parts = [chunks]
            else:
                parts, buffered, total = [], 0, 0
                async for chunk in chunks:
                    n = len(chunk)
                    if not n:
                        continue
                    total += n
                    if total > size:
                        raise DigestMismatch(f"blob {what}: more than the declared {size} bytes")
                    parts.append(chunk)
                    buffered += n
                    if buffered >= WRITE_BATCH:
                        if hashed is not None:
                            data = await self._wait_io(hashed, what)
                            if written is not None:
                                await self._wait_io(written, what)
                            written = self._executor.submit(temp.append, data)
                        hashed = self._executor.submit(temp.digest_part, parts)
                        parts, buffered = [], 0
                if total != size:
                    raise DigestMismatch(f"blob {what}: got {total} bytes, declared {size}")
                if hashed is not None:
                    data = await self._wait_io(hashed, what)
                    hashed = None
                    if written is not None:
                        await self._wait_io(written, what)
                    written = self._executor.submit(temp.append, data)
                if written is not None:
                    await self._wait_io(written, what)
                    written = None
            pending = self._executor.submit(temp.finish, parts)
            actual = await self._wait_io(pending, what)
            pending = None
            if digest is not None and actual != digest.hash:
                raise DigestMismatch(f"blob {what}: content hashes to {actual}")
            assert temp.path is not None
            return temp.path
        except BaseException:
            await self._settle(self._executor.submit(temp.abort, pending, hashed, written))
            raise

    async def _wait_io(self, cf: concurrent.futures.Future[Any], what: object) -> Any:
        try:
            return await asyncio.wrap_future(cf)
        except OSError as e:
            raise _storage_error(e, f"writing {what}") from e

    async def _store(
        self,
        key: bytes,
        digest: Digest | None,
        size: int,
        chunks: AsyncIterable[bytes] | bytes,
        what: object,
        *,
        replace: bool,
    ) -> None:
        """Reserve, receive into a temp file, publish: the one write path of CAS and AC.

        Entries up to SMALL_OP bytes are gathered first and take the coalesced path instead.
        """
        reservation = await self._reserve(size, what)
        if size <= SMALL_OP:
            try:
                if isinstance(chunks, bytes):
                    data = chunks
                else:
                    parts, total = [], 0
                    async for chunk in chunks:
                        total += len(chunk)
                        if total > size:
                            raise DigestMismatch(f"blob {what}: more than the declared {size} bytes")
                        parts.append(chunk)
                    if total != size:
                        raise DigestMismatch(f"blob {what}: got {total} bytes, declared {size}")
                    data = parts[0] if len(parts) == 1 else b"".join(parts)
                data = bytes(data)
            except BaseException:
                reservation.release()
                raise
            await self._store_small(key, digest, data, reservation, what, replace=replace)
            return
        try:
            temp = await self._receive(digest, size, chunks, what)
        except BaseException:
            reservation.release()
            raise
        await self._publish(key, temp, reservation, replace=replace)

    async def _publish(self, key: bytes, temp: str, reservation: _Reservation, *, replace: bool) -> None:
        """Rename a verified temp file into place and index it; owns `temp` and `reservation`.

        At most one rename or unlink per key is in flight, so the index never says "present" for a
        file an eviction is about to remove, nor the reverse. Once the rename starts it completes
        and is indexed even if the caller is cancelled.
        """
        duplicate = False
        try:
            duplicate = not await self._claim(key, replace)  # False: a concurrent writer got there first
        except BaseException:
            duplicate = True
            raise
        finally:
            if duplicate:
                reservation.release()
                await self._settle(self._executor.submit(_unlink_quiet, temp))
        if duplicate:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._publishing[key] = done
        task = asyncio.ensure_future(self._rename_and_index(key, temp, reservation, done))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        await asyncio.shield(task)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("publish failed: %s", task.exception())

    async def _rename_and_index(self, key: bytes, temp: str, reservation: _Reservation, done: asyncio.Future[None]) -> None:
        try:
            try:
                await self._io(_rename, temp, self._path(key), what=f"publishing {self._path(key)}")
            except BaseException:
                await self._settle(self._executor.submit(_unlink_quiet, temp))
                raise
            self._indexed(key, reservation)
        finally:
            reservation.release()
            del self._publishing[key]
            done.set_result(None)

    def _indexed(self, key: bytes, reservation: _Reservation) -> None:
        """The entry's file is in place: index it, turning its reservation into used bytes."""
        if key in self._index:
            self._forget(key)
        size = reservation.size
        reservation.release()
        self._index[key] = self._now()
        if key[0] == _AC_TAG:
            self._ac_sizes[key] = size
            self._ac_published += 1
        self._used += size
        self._unsynced = True
        if self._tracking is not None:
            self._tracking.add(_dir_id(key))

    async def _claim(self, key: bytes, replace: bool) -> bool:
        """Wait until no rename or unlink of `key` is in flight. False: a CAS entry that another
        writer published meanwhile (touched; nothing to do)."""
        while True:
            if not replace and key in self._index:
                self._touch(key)
                return False
            other = self._publishing.get(key) or self._deleting.get(key)
            if other is None:
                return True
            if other.done():  # finished, its clean-up callback not yet run: awaiting would not yield
                if self._deleting.get(key) is other:
                    del self._deleting[key]
                continue
            try:
                await asyncio.shield(other)
            except Exception:  # noqa: BLE001 - only waiting for the slot; its outcome is re-checked
                pass

    async def _store_small(
        self, key: bytes, digest: Digest | None, data: bytes, reservation: _Reservation, what: object, *, replace: bool
    ) -> None:
        """Verify, write and publish a small entry in one coalesced operation (see _Coalescer);
        owns `reservation`. Once submitted, the operation completes and is indexed even if the
        caller is cancelled.
        """
        try:
            if not await self._claim(key, replace):
                reservation.release()
                if digest is not None:  # published by a concurrent writer: still, these bytes must be right
                    await self._ops.submit(_check_hash, (data, digest))
                return
        except BaseException:
            reservation.release()
            raise
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._publishing[key] = done

        def finished(future: asyncio.Future[None]) -> None:
            try:
                if not future.cancelled() and future.exception() is None:
                    self._indexed(key, reservation)
                    if key[0] == _AC_TAG:
                        self._cache(key, data)
            finally:
                reservation.release()
                del self._publishing[key]
                done.set_result(None)

        future = self._ops.submit(_write_small, (self._tmp_dir, self._path(key), data, digest), len(data))
        future.add_done_callback(finished)
        try:
            await asyncio.shield(future)
        except OSError as e:
            raise _storage_error(e, f"writing {what}") from e

    # -- operations used by the two views ------------------------------------------------------

    def _find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        """The hot loop of FindMissingBlobs (1,000 digests a call): keys built inline, duplicates
        found by key. Hits count as uses (moved to the newest end)."""
        index = self._index
        now = self._now()
        fn_byte = _FN_BYTE
        fromhex = bytes.fromhex
        seen: set[object] = set()
        missing: list[Digest] = []
        for digest in digests:
            try:
                key = fn_byte[digest.function] + fromhex(digest.hash) + digest.size_bytes.to_bytes(_SIZE_BYTES, "big")
                if len(key) != 39:
                    key = digest  # malformed: never stored
            except (ValueError, TypeError, OverflowError):
                key = digest
            if key in seen:
                continue
            seen.add(key)
            if index.pop(key, None) is None:  # type: ignore[call-overload]
                missing.append(digest)
            else:  # a client told "present" will reference it soon: keep it
                index[key] = now  # type: ignore[index]
        return missing

    def _missing_indices(self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]) -> list[int]:
        """_find_missing without Digest objects: positions of the absent (first occurrences)."""
        index = self._index
        now = self._now()
        fn_byte = _FN_BYTE[function]
        fromhex = bytes.fromhex
        missing: list[int] = []
        unique = len(set(hashes)) == len(hashes)  # the usual case: no need to track duplicates
        seen: set[object] = set()
        for i, (hex_hash, size) in enumerate(zip(hashes, sizes)):
            try:
                key: Any = fn_byte + fromhex(hex_hash) + size.to_bytes(_SIZE_BYTES, "big")
                if len(key) != 39:
                    key = (hex_hash, size)  # malformed: never stored
            except (ValueError, TypeError, OverflowError):
                key = (hex_hash, size)
            if not unique:
                if key in seen:
                    continue
                seen.add(key)
            if index.pop(key, None) is None:
                missing.append(i)
            else:  # a client told "present" will reference it soon: keep it
                index[key] = now
        return missing

    async def _read(self, digest: Digest, offset: int, limit: int) -> AsyncIterator[bytes]:
        self._check_open()
        try:
            key = _cas_key(digest)
        except InvalidDigest:
            raise NotFound(f"blob {digest} not found") from None
        if key not in self._index:
            raise NotFound(f"blob {digest} not found")
        size = digest.size_bytes
        if offset < 0 or offset > size or limit < 0:
            raise InvalidRange(f"read offset {offset}/limit {limit} out of range for blob {digest}")
        end = size if limit == 0 else min(size, offset + limit)
        self._touch(key)
        path = self._path(key)
        first = min(CHUNK_SIZE, end - offset)
        fd: int | None = None
        try:
            if size <= SMALL_OP:  # whole, in a coalesced trip; no file stays open
                status, data = await self._ops.submit(_read_small, (path, size, offset, end))
            else:
                cf = self._executor.submit(_open_range, path, size, offset, first, end)
                try:
                    status, fd, data = await asyncio.wrap_future(cf)
                except asyncio.CancelledError:
                    cf.add_done_callback(_close_opened)
                    raise
        except OSError as e:
            raise _storage_error(e, f"reading {digest}") from e
        if status == _DAMAGED and key in self._index and key not in self._publishing:
            # Bit rot or a hand edit: a NotFound makes the client upload it again.
            log.error("%s does not have the size its name says; deleting it", path)
            self._forget(key)
            self._delete_file(key)
        elif status == _MISSING:
            self._drop_missing(key)
        if status != _OK:
            raise NotFound(f"blob {digest} not found")
        if len(data) != first:
            raise StorageError(f"blob {digest} is shorter on disk than its size")
        if fd is None:
            return _WholeChunks(data)
        return _FileChunks(self._executor, fd, data, offset + len(data), end, str(digest))

    async def _read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        """Whole blobs (BatchReadBlobs): every small one in one coalesced operation, the rest one by one."""
        self._check_open()
        results: list[bytes | Exception | None] = [None] * len(digests)
        index = self._index
        now = self._now()
        fromhex = bytes.fromhex
        cas_dir = self._cas_dir
        batch: list[tuple[str, int]] = []
        where: list[tuple[int, bytes, Digest]] = []
        singles: list[int] = []
        for i, digest in enumerate(digests):
            hex_hash, size, function = digest.hash, digest.size_bytes, digest.function
            try:
                key = _FN_BYTE[function] + fromhex(hex_hash) + size.to_bytes(_SIZE_BYTES, "big")
            except (ValueError, TypeError, OverflowError):
                key = b""
            if len(key) != 39 or index.pop(key, None) is None:
                results[i] = NotFound(f"blob {digest} not found")
                continue
            index[key] = now  # read: a use
            if size > SMALL_OP:
                singles.append(i)
            else:
                batch.append((f"{cas_dir}/{function.label}/{hex_hash[:2]}/{hex_hash}-{size}", size))
                where.append((i, key, digest))
        if batch:
            found = await self._ops.submit(_read_many, (batch,), 0)
            for (i, key, digest), (status, data) in zip(where, found):
                if status == _OK:
                    results[i] = data
                    continue
                if status == -1:
                    results[i] = _storage_error(data, f"reading {digest}")  # type: ignore[arg-type]
                    continue
                if status == _DAMAGED and key in self._index and key not in self._publishing:
                    log.error("%s does not have the size its name says; deleting it", self._path(key))
                    self._forget(key)
                    self._delete_file(key)
                elif status == _MISSING:
                    self._drop_missing(key)
                results[i] = NotFound(f"blob {digests[i]} not found")
        for i in singles:
            try:
                results[i] = b"".join([chunk async for chunk in await self._read(digests[i], 0, 0)])
            except StorageError as e:
                results[i] = e
        return results  # type: ignore[return-value]

    async def _write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        """Whole blobs (BatchUpdateBlobs). The common case (small, new, room without evicting,
        no other write of the same blob in flight) is reserved and claimed here and written in one
        coalesced operation; any other goes the one-by-one way. Like _store_small, a submitted
        write completes and is indexed even if the caller is cancelled."""
        self._check_open()
        outcomes: list[Exception | None] = [None] * len(items)
        index = self._index
        batch: list[tuple[str, str, bytes, Digest | None]] = []
        claimed: list[tuple[int, bytes, _Reservation, asyncio.Future[None]]] = []
        others: list[int] = []
        contended: set[int] = set()
        loop = asyncio.get_running_loop()
        for i, (digest, data) in enumerate(items):
            size = digest.size_bytes
            try:
                key = _cas_key(digest)
            except InvalidDigest as e:
                outcomes[i] = e
                continue
            if key in index:
                self._touch(key)  # stored and verified already: the bytes need not be read
                continue
            if key in self._publishing or key in self._deleting:
                contended.add(i)  # e.g. the same blob twice in one batch: these bytes get checked too
                others.append(i)
                continue
            if len(data) != size or size > SMALL_OP or self._used + self._reserved + size > self.max_size:
                others.append(i)
                continue
            reservation = _Reservation(self, size)
            done: asyncio.Future[None] = loop.create_future()
            self._publishing[key] = done
            batch.append((self._tmp_dir, self._path(key), bytes(data), digest))
            claimed.append((i, key, reservation, done))
        if batch:
            future = self._ops.submit(_write_many, (batch,), sum(len(item[2]) for item in batch))

            def finished(future: asyncio.Future[list[Exception | None]]) -> None:
                results = None if future.cancelled() else (future.exception() or future.result())
                for n, (i, key, reservation, done) in enumerate(claimed):
                    error = results if isinstance(results, BaseException) else None if results is None else results[n]
                    try:
                        if results is not None and error is None:
                            self._indexed(key, reservation)
                        else:
                            outcomes[i] = error if isinstance(error, Exception) else StorageError("write abandoned")
                    finally:
                        reservation.release()
                        del self._publishing[key]
                        done.set_result(None)

            future.add_done_callback(finished)
            await asyncio.shield(future)
            for i, *_rest in claimed:
                error = outcomes[i]
                if isinstance(error, OSError):
                    outcomes[i] = _storage_error(error, f"writing {items[i][0]}")
        if others:

            async def one(i: int) -> Exception | None:
                digest, data = items[i]
                try:
                    if i in contended and len(data) == digest.size_bytes <= SMALL_OP:
                        await self._ops.submit(_check_hash, (bytes(data), digest))
                    await self._write(digest, _single(data))
                    return None
                except Exception as e:  # noqa: BLE001 - that blob's outcome
                    return e

            for i, outcome in zip(others, await asyncio.gather(*(one(i) for i in others))):
                outcomes[i] = outcome
        return outcomes

    async def _lookup(self, function: DigestFunction, hex_hash: str) -> Digest:
        """A stored blob by hash alone: the size from a small memo, else from the names in the
        blob's shard directory (one listing, in the pool), confirmed by the index."""
        self._check_open()
        try:
            raw = bytes.fromhex(hex_hash)
        except (ValueError, TypeError):
            raw = b""
        if len(raw) != 32 or raw.hex() != hex_hash:
            raise NotFound(f"blob {function.label}:{str(hex_hash)[:64]} not found")
        prefix = _FN_BYTE[function] + raw
        index = self._index
        size = self._sizes.get(prefix)
        if size is None or prefix + size.to_bytes(_SIZE_BYTES, "big") not in index:
            directory = f"{self._cas_dir}/{function.label}/{hex_hash[:2]}"
            try:
                sizes = await self._ops.submit(_sizes_named, (directory, hex_hash))
            except OSError as e:
                raise _storage_error(e, f"looking up {hex_hash}") from e
            size = next((n for n in sizes if 0 <= n < _MAX_BLOB and prefix + n.to_bytes(_SIZE_BYTES, "big") in index), None)
            if size is None:
                raise NotFound(f"blob {function.label}:{hex_hash} not found")
            if len(self._sizes) >= 1 << 16:
                self._sizes.clear()
            self._sizes[prefix] = size
        return Digest(hex_hash, size, function)

    async def _write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        self._check_open()
        size = digest.size_bytes
        if size > self.max_size:
            raise CapacityExceeded(f"blob {digest} is larger than the store's {self.max_size} bytes")
        key = _cas_key(digest)
        if key in self._index:
            # Already stored and verified when it was written: do not read the stream at all.
            self._touch(key)
            return
        await self._store(key, digest, size, chunks, digest, replace=False)

    async def _ac_get(self, namespace: str, digest: Digest) -> bytes:
        self._check_open()
        key = self._ac_key(namespace, digest)
        if key not in self._index:
            raise NotFound(f"no entry for {digest} in {namespace!r}")
        self._touch(key)
        data = self._ac_cache.get(key)
        if data is not None:
            return data
        published = self._ac_published
        try:
            data = await self._ops.submit(_read_file, (self._path(key),))
        except OSError as e:
            raise _storage_error(e, f"reading {namespace!r} entry {digest}") from e
        if data is None:
            self._drop_missing(key)
            raise NotFound(f"no entry for {digest} in {namespace!r}")
        if published == self._ac_published and key in self._index and key not in self._publishing:
            self._cache(key, data)  # no entry was replaced meanwhile: this is the current one
        return data

    async def _ac_put(self, namespace: str, digest: Digest, data: bytes) -> None:
        self._check_open()
        key = self._ac_key(namespace, digest)
        data = bytes(data)
        size = len(data)
        await self._store(key, None, size, data, f"{namespace!r} entry {digest}", replace=True)


class DiskBlobStore:
    """BlobStore over a DiskStorage (CAS half). Get one from `DiskStorage.open(...).cas`."""

    def __init__(self, storage: DiskStorage) -> None:
        self.storage = storage

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        """In-memory only: no syscalls. Hits count as uses (they are about to be referenced)."""
        return self.storage._find_missing(digests)

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        return await self.storage._read(digest, offset, limit)

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        """Verify and publish atomically. An already stored blob returns at once, leaving `chunks` unread."""
        await self.storage._write(digest, chunks)

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        return await self.storage._lookup(function, hash)

    async def find_missing_indices(self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]) -> list[int]:
        """find_missing for parallel lists of hex hashes and sizes (no Digest objects: FindMissingBlobs'
        hot path): the positions of the absent ones, first occurrences only, in order."""
        self.storage._check_open()
        return self.storage._missing_indices(function, hashes, sizes)

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        """Whole blobs, each its bytes or its error (NotFound...): small ones in one pool trip."""
        return await self.storage._read_blobs(digests)

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        """Store whole blobs, each verified: None or the error, each. Small ones in one pool trip."""
        return await self.storage._write_blobs(items)

    def stats(self) -> DiskStats:
        return self.storage.stats()


class DiskActionStore:
    """ActionStore over a DiskStorage (AC half): own subtree, same cap and LRU as the CAS."""

    def __init__(self, storage: DiskStorage) -> None:
        self.storage = storage

    async def get(self, namespace: str, digest: Digest) -> bytes:
        return await self.storage._ac_get(namespace, digest)

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        await self.storage._ac_put(namespace, digest, data)
