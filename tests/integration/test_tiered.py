"""The tiered store, upload journal and object tier against a real S3-compatible HTTP server.

moto's ThreadedMotoServer runs on loopback for the module; outages are simulated by a TCP proxy
in front of it that can be stopped (refusing and cutting connections) and started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import s3_server
from s3_server import bucket_keys, free_port, raw_client, session

from buildvault.config import Settings
from buildvault.digest import Digest
from buildvault.storage import CHUNK_SIZE, NotFound, Unavailable, ac_namespace
from buildvault.storage.build import build_object_tier
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore
from buildvault.storage.objectstore.journal import AC, CAS, JournalBusy, JournalEntry, UploadJournal
from buildvault.storage.objectstore.tier import ObjectTier

# Fixtures from s3_server (bound by name so pytest finds them in this module).
aws_env = s3_server.aws_env
bucket = s3_server.bucket
s3_endpoint = s3_server.s3_endpoint

MiB = 1 << 20
REPO_SRC = Path(__file__).resolve().parents[2] / "src"


class TcpProxy:
    """Loopback TCP proxy; stop() refuses new connections and cuts the open ones."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        listener.settimeout(0.05)
        self._listener = listener
        self._running.set()
        self._thread = threading.Thread(target=self._accept_loop, args=(listener,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept_loop(self, listener: socket.socket) -> None:
        while self._running.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def proxy(s3_endpoint):
    host, port = s3_endpoint.removeprefix("http://").split(":")
    p = TcpProxy((host, int(port)))
    p.start()
    yield p
    p.stop()


FAST = dict(
    timeout=2.0,
    budget=2.0,  # the test S3 server answers HEADs one at a time, slowly on a loaded machine
    max_attempts=1,
    connect_timeout=1.0,
    read_timeout=3.0,
    journal_options=dict(initial_backoff=0.05, max_backoff=0.3),
    health_options=dict(initial_backoff=0.05, max_backoff=0.3),
)


@pytest.fixture
async def make_tier(tmp_path):
    tiers: list[ObjectTier] = []
    disks = []

    async def make(
        endpoint: str, bucket: str, name: str, *, read_only: bool = False, disk: bool = False, **kw
    ) -> ObjectTier:
        root = tmp_path / name
        settings = Settings(
            dir=root, s3_endpoint=endpoint, s3_bucket=bucket, s3_region="us-east-1", s3_read_only=read_only
        )
        if disk:
            from buildvault.storage.disk import DiskStorage

            storage = await DiskStorage.open(root / "disk", 1 << 30, checkpoint_interval=None)
            disks.append(storage)
            fast_cas, fast_ac = storage.cas, storage.ac
        else:
            fast_cas, fast_ac = MemoryBlobStore(), MemoryActionStore()
        tier = build_object_tier(settings, fast_cas, fast_ac, root, session=session(), **{**FAST, **kw})
        assert tier is not None
        await tier.start()
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        await tier.aclose()
    for storage in disks:
        await storage.close()


@pytest.fixture(params=["memory", "disk"])
def on_disk(request) -> bool:
    """Run a test with memory fast tiers and again with the disk store as the fast tier."""
    return request.param == "disk"


async def chunked(data: bytes, size: int = 256 * 1024):
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def read_all(store, digest: Digest, offset: int = 0, limit: int = 0) -> bytes:
    return b"".join([chunk async for chunk in await store.read(digest, offset, limit)])


def make_blobs(n: int, tag: str, size: int = 100) -> list[tuple[Digest, bytes]]:
    out = []
    for i in range(n):
        data = f"{tag}-{i}-{uuid.uuid4().hex}".encode().ljust(size, b".")
        out.append((Digest.of(data), data))
    return out


async def write_all(store, blobs) -> None:
    await asyncio.gather(*(store.write(d, chunked(b)) for d, b in blobs))


# -- journal -------------------------------------------------------------------------------


async def test_journal_survives_restart(tmp_path):
    directory = tmp_path / "journal"
    journal = await UploadJournal(directory).open()
    blobs = [Digest.of(b"blob-%d" % i) for i in range(50)]
    await asyncio.gather(*(journal.add_blob(d) for d in blobs))
    await journal.add_blob(blobs[0])  # a duplicate is a second entry (the uploader skips it cheaply)
    actions = [
        (ac_namespace("inst"), Digest.of(b"a1")),
        (ac_namespace(""), Digest.of(b"a2")),
        (ac_namespace("x", "raw"), Digest.of(b"a3")),
    ]
    for namespace, digest in actions:
        await journal.add_action(namespace, digest)
    assert journal.backlog == 54
    # the second process on the same directory is refused while the first holds it
    with pytest.raises(JournalBusy):
        await UploadJournal(directory).open()
    await journal.close()

    reopened = await UploadJournal(directory, concurrency=4).open()
    assert reopened.backlog == 54
    assert reopened.oldest_pending_age > 0
    seen: list[JournalEntry] = []

    async def handler(entry: JournalEntry) -> int:
        seen.append(entry)
        return entry.digest.size_bytes

    reopened.start(handler)
    assert await reopened.wait_drained(10)
    assert sorted(e.digest.hash for e in seen if e.kind == CAS) == sorted(d.hash for d in blobs + blobs[:1])
    assert {(e.namespace, e.digest) for e in seen if e.kind == AC} == set(actions)
    assert reopened.uploads_ok == 54 and reopened.backlog == 0 and reopened.oldest_pending_age == 0
    expected_bytes = sum(d.size_bytes for d in blobs + blobs[:1]) + sum(d.size_bytes for _, d in actions)
    assert reopened.bytes_uploaded == expected_bytes
    await reopened.close()
    assert not [p for p in (directory / "q").rglob("*") if p.is_file()]


KILL_SCRIPT = r"""
import asyncio, sys
from buildvault.digest import Digest
from buildvault.storage.objectstore.journal import UploadJournal

async def main():
    journal = await UploadJournal(sys.argv[1]).open()
    await asyncio.gather(*(journal.add_blob(Digest.of(b"blob-%d" % i)) for i in range(200)))
    await journal.add_action("ac/inst", Digest.of(b"action"))
    print("acked 200", flush=True)
    i = 200
    while True:
        await journal.add_blob(Digest.of(b"blob-%d" % i))
        print("ok", i, flush=True)
        i += 1

asyncio.run(main())
"""


async def test_journal_survives_kill_9(tmp_path):
    directory = tmp_path / "journal"
    env = {**os.environ, "PYTHONPATH": str(REPO_SRC)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILL_SCRIPT, str(directory), stdout=asyncio.subprocess.PIPE, env=env
    )
    last_acked = -1
    try:
        while last_acked < 260:
            line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
            assert line, "journal subprocess exited early"
            if line.startswith("ok "):
                last_acked = int(line.split()[1])
    finally:
        proc.send_signal(signal.SIGKILL)  # mid-add: the next entries are being written right now
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL

    journal = await UploadJournal(directory, concurrency=8).open()
    assert journal.backlog >= last_acked + 2  # blobs 0..last_acked and the action entry
    seen: set[tuple[str, str]] = set()

    async def handler(entry: JournalEntry) -> int:
        seen.add((entry.kind, entry.digest.hash))
        return 0

    journal.start(handler)
    assert await journal.wait_drained(15)
    expected = {(CAS, Digest.of(b"blob-%d" % i).hash) for i in range(last_acked + 1)}
    expected.add((AC, Digest.of(b"action").hash))
    assert expected <= seen
    await journal.close()


async def test_journal_retries_with_backoff_and_never_drops(tmp_path):
    journal = await UploadJournal(tmp_path / "j", initial_backoff=0.02, max_backoff=0.1, entry_max_backoff=0.1).open()
    digests = [Digest.of(b"r-%d" % i) for i in range(10)]
    for d in digests:
        await journal.add_blob(d)
    attempts: dict[str, int] = {}
    outage = 3

    async def handler(entry: JournalEntry) -> int:
        nonlocal outage
        if outage > 0:
            outage -= 1
            raise Unavailable("bucket down")
        attempts[entry.digest.hash] = attempts.get(entry.digest.hash, 0) + 1
        if entry.digest == digests[0] and attempts[entry.digest.hash] < 3:
            raise RuntimeError("this one entry is unlucky")
        return 1

    journal.start(handler)
    assert await journal.wait_drained(10)
    assert journal.uploads_ok == 10
    assert journal.uploads_failed >= 5
    assert attempts[digests[0].hash] == 3
    await journal.close()


async def test_journal_holds_entries_until_released(tmp_path):
    journal = await UploadJournal(tmp_path / "j").open()
    uploaded: list[Digest] = []

    async def handler(entry: JournalEntry) -> int:
        uploaded.append(entry.digest)
        return 0

    journal.start(handler)
    held = await journal.add_blob(Digest.of(b"held"), hold=True)
    dropped = await journal.add_blob(Digest.of(b"dropped"), hold=True)
    await journal.add_blob(Digest.of(b"free"))
    assert await journal.wait_until(lambda j: len(uploaded) == 1, 5)
    assert not await journal.wait_until(lambda j: len(uploaded) > 1, 0.2)
    assert journal.backlog == 2
    await journal.discard(dropped)
    journal.release(held)
    assert await journal.wait_drained(5)
    assert uploaded == [Digest.of(b"free"), Digest.of(b"held")]
    await journal.close()


async def test_journal_close_keeps_only_the_undone_part_of_a_batch(tmp_path):
    directory = tmp_path / "j"
    journal = await UploadJournal(directory, entry_max_backoff=60, initial_backoff=60).open()
    digests = [Digest.of(b"p-%d" % i) for i in range(10)]
    await asyncio.gather(*(journal.add_blob(d) for d in digests))  # one group commit: one file
    assert len(list((directory / "q").iterdir())) == 1

    async def handler(entry: JournalEntry) -> int:
        if digests.index(entry.digest) % 2:
            raise RuntimeError("not now")
        return 0

    journal.start(handler)
    assert await journal.wait_until(lambda j: j.uploads_ok == 5 and j.uploads_failed == 5, 5)
    await journal.close()
    files = list((directory / "q").iterdir())
    assert len(files) == 1 and files[0].name.endswith("-5.jnl")

    reopened = await UploadJournal(directory).open()
    assert reopened.backlog == 5
    seen: list[Digest] = []

    async def record(entry: JournalEntry) -> int:
        seen.append(entry.digest)
        return 0

    reopened.start(record)
    assert await reopened.wait_drained(5)
    assert seen == digests[1::2]
    await reopened.close()


# -- tiered store --------------------------------------------------------------------------


async def test_write_read_upload_round_trip(s3_endpoint, bucket, make_tier, on_disk):
    tier = await make_tier(s3_endpoint, bucket, "a", disk=on_disk)
    blobs = make_blobs(20, "rt") + [(Digest.of(d := os.urandom(3 * CHUNK_SIZE + 7)), d)]
    assert await tier.cas.find_missing([d for d, _ in blobs]) == [d for d, _ in blobs]
    await write_all(tier.cas, blobs)
    action = Digest.of(b"action-rt")
    await tier.ac.put(ac_namespace("inst"), action, b"result")
    assert await tier.cas.find_missing([d for d, _ in blobs]) == []
    for d, data in blobs:
        assert await read_all(tier.cas, d) == data
    assert await tier.ac.get(ac_namespace("inst"), action) == b"result"
    assert await tier.journal.wait_drained(15)
    keys = bucket_keys(s3_endpoint, bucket)
    assert {f"cas/sha256/{d.hash}" for d, _ in blobs} | {f"ac/ac/inst/sha256/{action.hash}"} == keys
    assert tier.journal.bytes_uploaded == sum(d.size_bytes for d, _ in blobs) + len(b"result")
    assert tier.journal.uploads_ok == len(blobs) + 1


async def test_two_servers_share_one_bucket(s3_endpoint, bucket, make_tier, on_disk):
    a = await make_tier(s3_endpoint, bucket, "a", disk=on_disk)
    b = await make_tier(s3_endpoint, bucket, "b")
    blobs = make_blobs(5, "shared") + [(Digest.of(d := os.urandom(2 * CHUNK_SIZE + 3)), d)]
    await write_all(a.cas, blobs)
    action = Digest.of(b"shared-action")
    await a.ac.put(ac_namespace(""), action, b"action-result")
    assert await a.journal.wait_drained(15)

    with pytest.raises(NotFound):
        await b.ac.get(ac_namespace("other"), action)
    assert await b.ac.get(ac_namespace(""), action) == b"action-result"
    assert await b.ac.fast.get(ac_namespace(""), action) == b"action-result"  # cached locally
    assert await b.cas.find_missing([d for d, _ in blobs]) == []
    assert await b.cas.fast.find_missing([d for d, _ in blobs]) == [d for d, _ in blobs]
    for d, data in blobs:
        assert await read_all(b.cas, d) == data
    # reads backfilled B's fast tier: the next reads never touch the bucket
    assert await b.cas.fast.find_missing([d for d, _ in blobs]) == []
    gets = b.object_store.request_counts["GET"]
    for d, data in blobs:
        assert await read_all(b.cas, d) == data
    assert b.object_store.request_counts["GET"] == gets
    # B wrote nothing: it only read what A uploaded
    assert b.object_store.request_counts["PUT"] == 0
    # a ranged read of a bucket-only blob is served, not backfilled
    big_digest, big = blobs[-1]
    c = await make_tier(s3_endpoint, bucket, "c")
    assert await read_all(c.cas, big_digest, CHUNK_SIZE - 5, 10) == big[CHUNK_SIZE - 5 : CHUNK_SIZE + 5]
    assert await c.cas.fast.find_missing([big_digest]) == [big_digest]


def seed_bucket(bucket: str, blobs) -> None:
    """Put objects straight into the in-process moto server's state (no HTTP): fast setup."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for digest, data in blobs:
        backend.put_object(bucket, f"cas/{digest.function.label}/{digest.hash}", data)


async def test_warm_find_missing_makes_no_head_requests(s3_endpoint, bucket, make_tier):
    blobs = make_blobs(1000, "warm", size=64)
    digests = [d for d, _ in blobs]
    seed_bucket(bucket, blobs)

    # B learns with one HEAD per unknown digest, once; then answers without any request.
    b = await make_tier(s3_endpoint, bucket, "b")
    unknown = Digest.of(b"not in the bucket")
    started = time.perf_counter()
    assert await b.cas.find_missing(digests + [unknown]) == [unknown]
    cold = time.perf_counter() - started
    assert b.object_store.request_counts["HEAD"] == 1001
    before = dict(b.object_store.request_counts)
    started = time.perf_counter()
    assert await b.cas.find_missing(digests + [unknown]) == [unknown]  # the negative answer is cached too
    warm = time.perf_counter() - started
    assert b.object_store.request_counts == before
    print(
        f"find_missing of 1001 digests: cold {cold * 1000:.0f} ms (1001 HEADs), "
        f"warm {warm * 1000:.1f} ms (0 requests)"
    )

    # Concurrent callers share in-flight HEADs.
    c = await make_tier(s3_endpoint, bucket, "c")
    await asyncio.gather(*(c.cas.find_missing(digests[:100]) for _ in range(5)))
    assert c.object_store.request_counts["HEAD"] == 100

    # A learns from its own uploads: even once its fast tier lost them, no HEADs.
    a = await make_tier(s3_endpoint, bucket, "a")
    uploaded = make_blobs(100, "uploaded", size=64)
    await write_all(a.cas, uploaded)
    assert await a.journal.wait_drained(20)
    assert a.cas.fast.evict() == len(uploaded)  # all of them, as eviction would
    assert await a.cas.find_missing([d for d, _ in uploaded] + digests[:10]) == []
    assert a.object_store.request_counts["HEAD"] == 10


async def test_bucket_outage_fails_open_and_recovers(s3_endpoint, bucket, proxy, make_tier, caplog, on_disk):
    caplog.set_level(logging.INFO, logger="buildvault.storage")
    tier = await make_tier(proxy.endpoint, bucket, "a", disk=on_disk)
    before = make_blobs(10, "before")
    await write_all(tier.cas, before)
    assert await tier.journal.wait_drained(10)
    # a blob only the bucket holds (another server uploaded it)
    remote_data = b"uploaded by someone else"
    remote = Digest.of(remote_data)
    raw_client(s3_endpoint).put_object(Bucket=bucket, Key=f"cas/sha256/{remote.hash}", Body=remote_data)

    proxy.stop()
    during = make_blobs(30, "during") + [(Digest.of(d := os.urandom(CHUNK_SIZE + 11)), d)]
    started = time.perf_counter()
    await write_all(tier.cas, during)
    await tier.ac.put(ac_namespace(""), Digest.of(b"outage-action"), b"outage-result")
    write_time = time.perf_counter() - started
    assert tier.journal.backlog >= len(during) + 1
    assert await tier.journal.wait_until(lambda j: j.uploads_failed > 0, 10)
    assert not tier.health.healthy
    # reads and existence keep working from the local tier, without waiting on the bucket
    for d, data in during + before:
        assert await read_all(tier.cas, d) == data
    started = time.perf_counter()
    assert await tier.cas.find_missing([remote] + [d for d, _ in during]) == [remote]
    with pytest.raises(Unavailable):
        await tier.cas.read(remote)
    with pytest.raises(NotFound):
        await tier.ac.get(ac_namespace(""), Digest.of(b"not cached here"))
    degraded_time = time.perf_counter() - started
    assert degraded_time < 1.0
    more = make_blobs(10, "later")
    await write_all(tier.cas, more)
    assert tier.journal.backlog >= len(during) + len(more) + 1

    proxy.start()
    assert await tier.journal.wait_drained(20), tier.journal.stats()
    assert tier.health.healthy
    keys = bucket_keys(s3_endpoint, bucket)
    for d, _ in before + during + more + [(remote, b"")]:
        assert f"cas/sha256/{d.hash}" in keys
    assert f"ac/ac/sha256/{Digest.of(b'outage-action').hash}" in keys
    assert await read_all(tier.cas, remote) == remote_data
    down = [r for r in caplog.records if "is unavailable" in r.getMessage()]
    up = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(down) == 1 and len(up) == 1  # logged once per state change
    print(
        f"41 writes during outage: {write_time * 1000:.0f} ms; "
        f"degraded reads/find_missing: {degraded_time * 1000:.0f} ms"
    )


async def test_read_only_mode_never_writes(s3_endpoint, bucket, make_tier):
    a = await make_tier(s3_endpoint, bucket, "a")
    seeded = make_blobs(3, "seed")
    await write_all(a.cas, seeded)
    await a.ac.put(ac_namespace(""), Digest.of(b"ro-action"), b"seeded-result")
    assert await a.journal.wait_drained(10)
    keys_before = bucket_keys(s3_endpoint, bucket)

    ro = await make_tier(s3_endpoint, bucket, "ro", read_only=True)
    assert ro.journal is None and ro.object_store.read_only
    local = make_blobs(5, "local") + [(Digest.of(d := os.urandom(6 * MiB)), d)]
    await write_all(ro.cas, local)
    await ro.ac.put(ac_namespace(""), Digest.of(b"local-action"), b"local")
    for d, data in local + seeded:
        assert await read_all(ro.cas, d) == data
    assert await ro.ac.get(ac_namespace(""), Digest.of(b"ro-action")) == b"seeded-result"
    assert await ro.cas.find_missing([d for d, _ in local + seeded]) == []
    counts = ro.object_store.request_counts
    writes = {k: v for k, v in counts.items() if k in ("PUT", "DELETE") or k.startswith("MULTIPART")}
    assert set(writes.values()) == {0}
    assert bucket_keys(s3_endpoint, bucket) == keys_before


async def test_paused_uploads_wait_in_the_journal(s3_endpoint, bucket, make_tier):
    tier = await make_tier(s3_endpoint, bucket, "a")
    tier.pause_uploads()
    blobs = make_blobs(10, "paused")
    await write_all(tier.cas, blobs)
    assert tier.journal.backlog == 10
    assert not await tier.journal.wait_until(lambda j: j.uploads_ok > 0, 0.3)
    assert tier.object_store.request_counts["PUT"] == 0
    tier.resume_uploads()
    assert await tier.journal.wait_drained(10)
    assert tier.object_store.request_counts["PUT"] == 10

    off = await make_tier(s3_endpoint, bucket, "off", uploads=False)
    assert off.journal is None
    await write_all(off.cas, make_blobs(3, "off"))
    assert off.object_store.request_counts["PUT"] == 0


async def test_evicted_before_upload(s3_endpoint, bucket, make_tier):
    tier = await make_tier(s3_endpoint, bucket, "a")
    tier.pause_uploads()
    (gone, gone_data), (elsewhere, elsewhere_data) = make_blobs(2, "evicted")
    await write_all(tier.cas, [(gone, gone_data), (elsewhere, elsewhere_data)])
    raw_client(s3_endpoint).put_object(Bucket=bucket, Key=f"cas/sha256/{elsewhere.hash}", Body=elsewhere_data)
    assert tier.cas.fast.evict() == 2  # evicted from the local tier before the upload ran
    tier.resume_uploads()
    assert await tier.journal.wait_drained(10)
    assert tier.cas.counters["lost_uploads"] == 1
    assert tier.cas.counters["uploads_skipped"] == 1
    assert await tier.cas.find_missing([gone, elsewhere]) == [gone]


async def test_failed_local_write_leaves_no_journal_entry(s3_endpoint, bucket, make_tier):
    tier = await make_tier(s3_endpoint, bucket, "a")
    data = b"declared wrongly"
    bad = Digest(Digest.of(b"other").hash, len(data))
    with pytest.raises(ValueError):
        await tier.cas.write(bad, chunked(data))
    # the held entry was discarded: it leaves the journal without any upload attempt
    assert await tier.journal.wait_drained(5)
    assert tier.journal.uploads_ok == 0 and tier.journal.uploads_failed == 0
    assert tier.cas.counters["lost_uploads"] == 0
    assert tier.object_store.request_counts["PUT"] == 0


async def test_client_that_stops_reading_leaves_no_broken_copy(s3_endpoint, bucket, make_tier, on_disk):
    a = await make_tier(s3_endpoint, bucket, "a")
    data = os.urandom(4 * CHUNK_SIZE + 1)
    digest = Digest.of(data)
    await a.cas.write(digest, chunked(data))
    assert await a.journal.wait_drained(10)

    b = await make_tier(s3_endpoint, bucket, "b", disk=on_disk)
    stream = await b.cas.read(digest)
    first = await stream.__anext__()
    assert first == data[: len(first)]
    await stream.aclose()
    assert await b.cas.fast.find_missing([digest]) == [digest]
    assert await read_all(b.cas, digest) == data
    assert await b.cas.fast.find_missing([digest]) == []
    assert await read_all(b.cas.fast, digest) == data


async def test_corrupt_bucket_object_is_not_served_or_backfilled(s3_endpoint, bucket, make_tier, on_disk):
    a = await make_tier(s3_endpoint, bucket, "a")
    data = os.urandom(3 * CHUNK_SIZE)
    digest = Digest.of(data)
    await a.cas.write(digest, chunked(data))
    assert await a.journal.wait_drained(10)
    corrupted = bytearray(data)
    corrupted[-1] ^= 1
    raw_client(s3_endpoint).put_object(Bucket=bucket, Key=f"cas/sha256/{digest.hash}", Body=bytes(corrupted))

    b = await make_tier(s3_endpoint, bucket, "b", disk=on_disk)
    received = bytearray()
    with pytest.raises(NotFound):
        async for chunk in await b.cas.read(digest):
            received += chunk
    assert len(received) < len(data)
    assert b.object_store.corrupt_objects == 1
    assert await b.cas.fast.find_missing([digest]) == [digest]
    # the blob is now reported missing, so a client uploads it again, which repairs the bucket
    assert await b.cas.find_missing([digest]) == [digest]
    await b.cas.write(digest, chunked(data))
    assert await b.journal.wait_drained(10)
    c = await make_tier(s3_endpoint, bucket, "c")
    assert await read_all(c.cas, digest) == data


async def test_build_object_tier_without_bucket_is_none(tmp_path):
    assert build_object_tier(Settings(dir=tmp_path), MemoryBlobStore(), MemoryActionStore()) is None
