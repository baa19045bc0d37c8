#!/usr/bin/env python3
"""Small-blob layouts, measured: today's file per blob against a pack file, LMDB and SQLite WAL.

    .venv/bin/python bench/layout_bench.py [--blobs 20000] [--singles 1000] [--only files,pack]

Every candidate stores N blobs of 4 KiB (deterministic random bytes, keyed by their SHA-256)
with the durability the disk store gives today (docs/architecture.md, "Durability"):
- a write is acknowledged only once its bytes are with the kernel (survives kill -9), after its
  SHA-256 was checked; no fsync per write: a sync thread makes everything durable every second;
- a record is never served torn: every record carries a checksum checked on every read
  (files: the blob is re-hashed after an unclean stop instead);
- restart rebuilds what the store needs in memory to answer FindMissingBlobs and account for
  size (key -> size): the clean restart and the restart after kill -9 are both timed.

One run per candidate: a child process writes N blobs in batches of 100 (timed: BatchUpdateBlobs),
then `--singles` blobs one per call (timed), then keeps writing until the parent kills it with
SIGKILL. The parent reopens (timed: restart after kill -9), checks that every blob the child
acknowledged is there byte for byte, times batch and single reads, closes cleanly and reopens
(timed: clean restart). Every blocking call of the candidates runs in one worker thread per
store, as a server would run it (the file store uses its own thread pool). Prints a markdown
table and one JSON line per candidate.

Not measured here: eviction and compaction (a pack reclaims space by copying live records out of
its oldest segment), and memory per blob at 10 M blobs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from buildvault.digest import Digest  # noqa: E402
from buildvault.storage.disk import DiskStorage  # noqa: E402

BLOB_SIZE = 4096
BATCH = 100
SYNC_INTERVAL = 1.0  # seconds, as the disk store's syncer


def blob(i: int) -> bytes:
    return random.Random(i).randbytes(BLOB_SIZE)


def crc(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


class Corrupt(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Candidates: a synchronous store each (run in one worker thread), plus today's DiskStorage
# --------------------------------------------------------------------------------------------


class PeriodicSync:
    """Calls `sync` every SYNC_INTERVAL seconds while something changed, in its own thread."""

    def __init__(self, sync: Any) -> None:
        self._sync = sync
        self.dirty = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SYNC_INTERVAL):
            if self.dirty:
                self.dirty = False
                self._sync()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class PackStore:
    """One append-only pack file of records and an in-memory index hash -> (offset, size).

    Record: magic, size, SHA-256, CRC-32 of the data, the data. A batch is one write() at the
    tail. The sync thread fdatasyncs the pack and records the synced length in SYNC; a clean
    close writes the index snapshot (fsync) and marks SYNC clean. After an unclean stop the
    records behind the snapshot are scanned, each re-verified (CRC and SHA-256); the first bad
    or short record and everything after it is cut off.
    """

    fsync = "no fsync per write; fdatasync of the pack every 1 s; snapshot + SYNC fsync'd at close"
    HEADER = struct.Struct("<4sI32sI")
    MAGIC = b"BVR1"
    ENTRY = struct.Struct("<32sQI")

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.pack_path = root / "pack-0000.dat"
        self.fd = os.open(self.pack_path, os.O_RDWR | os.O_CREAT, 0o644)
        self.index: dict[bytes, tuple[int, int]] = {}
        self.tail = self._load()
        self._write_sync("running")
        self.syncer = PeriodicSync(self._sync)

    def _write_sync(self, state: str, length: int = 0) -> None:
        tmp = self.root / "SYNC.tmp"
        with open(tmp, "w", encoding="ascii") as handle:
            handle.write(f"{state} {length}\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.root / "SYNC")

    def _sync(self) -> None:
        length = self.tail
        os.fdatasync(self.fd)
        self._write_sync("running", length)

    def _load(self) -> int:
        state = (self.root / "SYNC").read_text(encoding="ascii").split() if (self.root / "SYNC").exists() else []
        snapshot = self.root / "index.snap"
        covered = 0
        if snapshot.exists():
            data = snapshot.read_bytes()
            (covered,) = struct.unpack_from("<Q", data, 0)
            for digest, offset, size in self.ENTRY.iter_unpack(memoryview(data)[8:]):
                self.index[digest] = (offset, size)
        end = os.fstat(self.fd).st_size
        if state and state[0] == "clean" and covered == end:
            return end
        return self._scan(covered, end)

    def _scan(self, offset: int, end: int) -> int:
        """Re-verify every record from `offset`; cut the pack at the first bad one."""
        with open(self.pack_path, "rb") as handle:
            handle.seek(offset)
            while offset + self.HEADER.size <= end:
                header = handle.read(self.HEADER.size)
                magic, size, digest, check = self.HEADER.unpack(header)
                if magic != self.MAGIC or offset + self.HEADER.size + size > end:
                    break
                data = handle.read(size)
                if crc(data) != check or hashlib.sha256(data).digest() != digest:
                    break
                self.index[digest] = (offset + self.HEADER.size, size)
                offset += self.HEADER.size + size
        if offset != end:
            os.ftruncate(self.fd, offset)
        return offset

    def write_batch(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        parts, placed, at = [], [], self.tail
        for digest, data in items:
            if hashlib.sha256(data).digest() != digest:
                raise Corrupt("digest mismatch")
            if digest in self.index:
                continue
            parts += [self.HEADER.pack(self.MAGIC, len(data), digest, crc(data)), data]
            placed.append((digest, at + self.HEADER.size, len(data)))
            at += self.HEADER.size + len(data)
        if not parts:
            return
        buffer = b"".join(parts)
        written = os.pwrite(self.fd, buffer, self.tail)
        if written != len(buffer):
            raise OSError("short write")
        self.tail = at
        for digest, offset, size in placed:  # visible only once the bytes are with the kernel
            self.index[digest] = (offset, size)
        self.syncer.dirty = True

    def read_batch(self, digests: Sequence[bytes]) -> list[bytes]:
        out = []
        for digest in digests:
            offset, size = self.index[digest]
            record = os.pread(self.fd, self.HEADER.size + size, offset - self.HEADER.size)
            _magic, _size, _digest, check = self.HEADER.unpack_from(record)
            data = record[self.HEADER.size :]
            if crc(data) != check:
                raise Corrupt(digest.hex())
            out.append(data)
        return out

    def close(self) -> None:
        self.syncer.stop()
        os.fsync(self.fd)
        entries = b"".join(self.ENTRY.pack(d, o, s) for d, (o, s) in self.index.items())
        tmp = self.root / "index.snap.tmp"
        with open(tmp, "wb") as handle:
            handle.write(struct.pack("<Q", self.tail) + entries)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.root / "index.snap")
        self._write_sync("clean", self.tail)
        os.close(self.fd)


class LmdbStore:
    """LMDB: key the raw SHA-256, value CRC-32 + data; one write transaction per batch.

    Opened with sync=False (MDB_NOSYNC): a commit is with the kernel (kill -9 safe; LMDB's
    copy-on-write B-tree is never torn by a process crash), env.sync() every 1 s makes it
    durable. Restart opens the map and walks the keys to rebuild key -> size.
    """

    fsync = "no fsync per commit (sync=False); env.sync() every 1 s and at close"

    def __init__(self, root: Path) -> None:
        import lmdb

        root.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(root), map_size=1 << 36, sync=False, metasync=False, readahead=False)
        self.index: dict[bytes, int] = {}
        with self.env.begin() as txn:
            for key, value in txn.cursor():
                self.index[bytes(key)] = len(value) - 4
        self.syncer = PeriodicSync(lambda: self.env.sync(True))

    def write_batch(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for digest, data in items:
            if hashlib.sha256(data).digest() != digest:
                raise Corrupt("digest mismatch")
        with self.env.begin(write=True) as txn:
            for digest, data in items:
                txn.put(digest, struct.pack("<I", crc(data)) + data, overwrite=False)
        for digest, data in items:
            self.index[digest] = len(data)
        self.syncer.dirty = True

    def read_batch(self, digests: Sequence[bytes]) -> list[bytes]:
        out = []
        with self.env.begin(buffers=True) as txn:
            for digest in digests:
                value = txn.get(digest)
                if value is None:
                    raise KeyError(digest.hex())
                data = bytes(value[4:])
                if crc(data) != struct.unpack_from("<I", value)[0]:
                    raise Corrupt(digest.hex())
                out.append(data)
        return out

    def close(self) -> None:
        self.syncer.stop()
        self.env.sync(True)
        self.env.close()


class SqliteStore:
    """SQLite in WAL mode, synchronous=NORMAL: a commit is in the WAL with the kernel (kill -9
    safe, the WAL's frame checksums drop a torn tail), fsync'd at WAL checkpoints; a checkpoint
    every 1 s stands in for the sync point. Rows: hash, size, CRC-32, data; one transaction per
    batch. Restart opens the database and selects hash, size."""

    fsync = "synchronous=NORMAL (no fsync per commit); WAL checkpoint (fsync) every 1 s and at close"

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / "blobs.sqlite"
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS blobs (hash BLOB PRIMARY KEY, size INT, crc INT, data BLOB)")
        self.index = {bytes(h): s for h, s in self.db.execute("SELECT hash, size FROM blobs")}
        self.lock = threading.Lock()  # the connection is shared with the checkpoint thread
        self.syncer = PeriodicSync(self._checkpoint)

    def _checkpoint(self) -> None:
        with self.lock:
            self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def write_batch(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for digest, data in items:
            if hashlib.sha256(data).digest() != digest:
                raise Corrupt("digest mismatch")
        rows = [(digest, len(data), crc(data), data) for digest, data in items]
        with self.lock:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR IGNORE INTO blobs VALUES (?, ?, ?, ?)", rows)
            self.db.execute("COMMIT")
        for digest, data in items:
            self.index[digest] = len(data)
        self.syncer.dirty = True

    def read_batch(self, digests: Sequence[bytes]) -> list[bytes]:
        out = []
        with self.lock:
            for digest in digests:
                row = self.db.execute("SELECT crc, data FROM blobs WHERE hash = ?", (digest,)).fetchone()
                if row is None:
                    raise KeyError(digest.hex())
                if crc(row[1]) != row[0]:
                    raise Corrupt(digest.hex())
                out.append(row[1])
        return out

    def close(self) -> None:
        self.syncer.stop()
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.db.close()


class Threaded:
    """A synchronous candidate behind one worker thread: one pool trip per call."""

    def __init__(self, kind: type[Any], root: Path) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.kind, self.root = kind, root
        self.store: Any = None

    async def open(self) -> None:
        self.store = await self._call(self.kind, self.root)

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def write_batch(self, items: list[tuple[bytes, bytes]]) -> None:
        await self._call(self.store.write_batch, items)

    async def read_batch(self, digests: list[bytes]) -> list[bytes]:
        result: list[bytes] = await self._call(self.store.read_batch, digests)
        return result

    async def close(self) -> None:
        await self._call(self.store.close)
        self.pool.shutdown()


class Files:
    """Today's store: DiskStorage, a file per blob (see docs/architecture.md)."""

    fsync = "no fsync per write (temp file + rename); syncfs every 1 s (SYNC point); clean close syncs"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.storage: DiskStorage | None = None

    async def open(self) -> None:
        self.storage = await DiskStorage.open(self.root, 1 << 40, checkpoint_interval=None)

    async def write_batch(self, items: list[tuple[bytes, bytes]]) -> None:
        assert self.storage is not None
        errors = await self.storage.cas.write_blobs([(Digest(d.hex(), len(b)), b) for d, b in items])
        if any(errors):
            raise Corrupt(str(next(e for e in errors if e)))

    async def read_batch(self, digests: list[bytes]) -> list[bytes]:
        assert self.storage is not None
        got = await self.storage.cas.read_blobs([Digest(d.hex(), BLOB_SIZE) for d in digests])
        for item in got:
            if isinstance(item, Exception):
                raise item
        return [item for item in got if isinstance(item, bytes)]

    async def close(self) -> None:
        assert self.storage is not None
        await self.storage.close()


CANDIDATES: dict[str, Any] = {
    "files": (Files, Files.fsync),
    "pack": (lambda root: Threaded(PackStore, root), PackStore.fsync),
    "lmdb": (lambda root: Threaded(LmdbStore, root), LmdbStore.fsync),
    "sqlite-wal": (lambda root: Threaded(SqliteStore, root), SqliteStore.fsync),
}


def make(name: str, root: Path) -> Any:
    return CANDIDATES[name][0](root)


# --------------------------------------------------------------------------------------------
# The child: write, acknowledge, keep writing until killed
# --------------------------------------------------------------------------------------------


def items_for(start: int, stop: int) -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(start, stop):
        data = blob(i)
        out.append((hashlib.sha256(data).digest(), data))
    return out


async def child(name: str, root: Path, blobs: int, singles: int) -> None:
    store = make(name, root)
    await store.open()
    batches = [items_for(i, min(i + BATCH, blobs)) for i in range(0, blobs, BATCH)]
    started = time.perf_counter()
    for batch in batches:
        await store.write_batch(batch)
    batch_us = (time.perf_counter() - started) / blobs * 1e6
    one_by_one = [items_for(i, i + 1) for i in range(blobs, blobs + singles)]
    started = time.perf_counter()
    for item in one_by_one:
        await store.write_batch(item)
    single_us = (time.perf_counter() - started) / max(singles, 1) * 1e6
    print(json.dumps({"batch_write_us": batch_us, "single_write_us": single_us, "acked": blobs + singles}), flush=True)
    at = blobs + singles
    while True:  # until SIGKILL: the kill lands in the middle of some write
        await store.write_batch(items_for(at, at + BATCH))
        at += BATCH
        print(json.dumps({"acked": at}), flush=True)


# --------------------------------------------------------------------------------------------
# The parent
# --------------------------------------------------------------------------------------------


async def timed_open(name: str, root: Path) -> tuple[Any, float]:
    store = make(name, root)
    started = time.perf_counter()
    await store.open()
    return store, time.perf_counter() - started


async def check_all(store: Any, acked: int) -> None:
    """Every acknowledged blob is there, byte for byte (off the clock)."""
    for start in range(0, acked, BATCH):
        want = items_for(start, min(start + BATCH, acked))
        got = await store.read_batch([d for d, _ in want])
        if got != [data for _, data in want]:
            raise SystemExit(f"acknowledged blobs {start}..{start + BATCH} lost or changed")


def du(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for file in files:
            total += os.lstat(os.path.join(dirpath, file)).st_blocks * 512
    return total


async def measure(name: str, work: Path, blobs: int, singles: int, extra_batches: int) -> dict[str, Any]:
    root = work / name
    process = subprocess.Popen(
        [sys.executable, __file__, "--child", name, "--dir", str(root), "--blobs", str(blobs),
         "--singles", str(singles)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    figures: dict[str, Any] = {}
    acked = 0
    for line in process.stdout:
        row = json.loads(line)
        figures.update({k: v for k, v in row.items() if k != "acked"})
        acked = row["acked"]
        if acked >= blobs + singles + extra_batches * BATCH:
            break
    process.send_signal(signal.SIGKILL)  # mid-way through the next batch
    process.wait()
    if acked < blobs + singles:
        raise SystemExit(f"{name}: the writer died after {acked} blobs")
    store, unclean = await timed_open(name, root)
    await check_all(store, acked)
    reads = items_for(0, blobs)
    started = time.perf_counter()
    for start in range(0, blobs, BATCH):
        await store.read_batch([d for d, _ in reads[start : start + BATCH]])
    batch_read_us = (time.perf_counter() - started) / blobs * 1e6
    started = time.perf_counter()
    for digest, _ in reads[:singles]:
        await store.read_batch([digest])
    single_read_us = (time.perf_counter() - started) / max(singles, 1) * 1e6
    await store.close()
    store, clean = await timed_open(name, root)
    await store.close()
    return {
        "candidate": name, "fsync": CANDIDATES[name][1], "blobs_acked_before_kill": acked,
        "batch_write_us": round(figures["batch_write_us"], 1), "single_write_us": round(figures["single_write_us"], 1),
        "batch_read_us": round(batch_read_us, 1), "single_read_us": round(single_read_us, 1),
        "restart_after_kill9_s": round(unclean, 3), "restart_clean_s": round(clean, 3),
        "disk_bytes_per_blob": round(du(root) / acked),
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | write µs/blob, batches of 100 | write µs, one per call | read µs/blob, batches of 100 "
        "| read µs, one per call | restart after kill -9 s | clean restart s | disk bytes/blob |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['candidate']} | {r['batch_write_us']:.0f} | {r['single_write_us']:.0f} | {r['batch_read_us']:.0f} "
            f"| {r['single_read_us']:.0f} | {r['restart_after_kill9_s']:.2f} | {r['restart_clean_s']:.2f} "
            f"| {r['disk_bytes_per_blob']:,} |"
        )
    return "\n".join(lines)


async def call_floor(calls: int = 2000) -> float:
    """µs of one empty worker-thread trip from the event loop: what every single call pays."""
    pool = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    for _ in range(calls):
        await loop.run_in_executor(pool, int)
    pool.shutdown()
    return (time.perf_counter() - started) / calls * 1e6


async def main_async(args: argparse.Namespace) -> None:
    names = [n.strip() for n in args.only.split(",")] if args.only else list(CANDIDATES)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bv-layout-"))
    rows = []
    try:
        for name in names:
            shutil.rmtree(work / name, ignore_errors=True)
            row = await measure(name, work, args.blobs, args.singles, args.extra_batches)
            row["load_1min"] = round(os.getloadavg()[0], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
            shutil.rmtree(work / name, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    print(f"\nfloor: one empty thread-pool trip from the event loop {await call_floor():.0f} µs")
    loads = [r["load_1min"] for r in rows]
    print(f"\n{args.blobs} blobs of {BLOB_SIZE} B, {args.singles} single calls; load (1 min) "
          f"{min(loads)}–{max(loads)}, median {statistics.median(loads):.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blobs", type=int, default=20000)
    parser.add_argument("--singles", type=int, default=1000, help="blobs written and read one per call")
    parser.add_argument("--extra-batches", type=int, default=3, help="batches acknowledged before the kill")
    parser.add_argument("--only", help="comma-separated candidates: " + ", ".join(CANDIDATES))
    parser.add_argument("--dir", help="work directory (default: a temp dir, removed)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(child(args.child, Path(args.dir), args.blobs, args.singles))
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
