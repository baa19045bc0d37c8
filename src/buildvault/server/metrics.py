"""Every Prometheus metric of the server, defined once and used by both protocols.

A `Metrics` object owns its own `CollectorRegistry` (never the process-global default), so two
servers in one process (tests) keep separate counts. The app creates one, hands it to the HTTP
app and to the gRPC server (through server/grpc/request_metrics.py), and serves
`Metrics.render()` at `/metrics` on the HTTP port.

Label values come from small fixed sets only: protocol (`grpc`, `http`), method (a known HTTP
method or RPC name, else `other`), kind (`ac`, `cas`, `capabilities`, `status`, `metrics`,
`other`, ...) and status (an HTTP code or a gRPC code name). A digest, an instance name or a
path is never a label value.

The S3/OBS tier (when a bucket is configured) is read at scrape time from the tier's `stats()`
(`Metrics.watch_object_tier(tier.stats)`): requests by operation (HEAD, GET, PUT, ...: the
object store's fixed request kinds), upload journal backlog and oldest pending age, upload
attempts ok/failed, bytes uploaded, presence-index size, tier health, and the tier's CAS/AC
events (fast/slow hits, backfills, lost uploads, ...). Without a bucket none of them appear.

Every store tier reports at its boundary (`Metrics` is storage's `StoreRecorder`): calls
by tier and operation, blob bytes read and written, action-entry lookups by result, with the
tier names of storage/build.py (`client`, `local`, `object_store`; without a bucket only
`client`, which is then the disk store). The client tier's bytes are
also the per-protocol `cas_read_bytes` / `cas_written_bytes` of the front end that set
`REQUEST_PROTOCOL` (the gRPC request wrapper and the HTTP middleware do); AC hits and misses
are counted by the ActionCache (actions.py) under the same protocol. No front end counts
bytes or hits itself.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from buildvault.storage import CLIENT_TIER

__all__ = ["Metrics", "StorageSnapshot", "CONTENT_TYPE_LATEST"]

PREFIX = "buildvault"
HTTP_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS", "PATCH"})
# gRPC services we know, by full name -> the `kind` label.
GRPC_SERVICES = {
    "build.bazel.remote.execution.v2.ActionCache": "ac",
    "build.bazel.remote.execution.v2.ContentAddressableStorage": "cas",
    "google.bytestream.ByteStream": "cas",
    "build.bazel.remote.execution.v2.Capabilities": "capabilities",
    "build.bazel.remote.execution.v2.Execution": "execution",
    "grpc.health.v1.Health": "health",
    "grpc.reflection.v1alpha.ServerReflection": "reflection",
    "grpc.reflection.v1.ServerReflection": "reflection",
}
GRPC_METHODS = frozenset(
    {
        "GetActionResult",
        "UpdateActionResult",
        "FindMissingBlobs",
        "BatchUpdateBlobs",
        "BatchReadBlobs",
        "GetTree",
        "SplitBlob",
        "SpliceBlob",
        "Read",
        "Write",
        "QueryWriteStatus",
        "GetCapabilities",
        "Execute",
        "WaitExecution",
        "Check",
        "Watch",
        "ServerReflectionInfo",
    }
)
# Request latency buckets: from a cache hit on loopback to a multi-GiB upload.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip
# Label values taken from the object tier's stats keys (fixed in code) must look like this.
_STATS_LABEL = re.compile(r"[a-z][a-z0-9_]{0,39}")
_MAX_STATS_LABELS = 32

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorageSnapshot:
    """What the storage gauges show; None where the store cannot tell (e.g. no size cap)."""

    used_bytes: int | None = None
    max_bytes: int | None = None
    blob_count: int | None = None
    ac_entries: int | None = None
    evictions: int | None = None
    oldest_item_age_seconds: float | None = None

    @classmethod
    def from_stats(cls, stats: Any) -> StorageSnapshot:
        """From a store's stats(): a mapping or an object with any of these attribute names."""
        if stats is None:
            return cls()
        if isinstance(stats, StorageSnapshot):
            return stats

        def pick(*names: str) -> Any:
            for name in names:
                value = stats.get(name) if isinstance(stats, Mapping) else getattr(stats, name, None)
                if value is not None:
                    return value
            return None

        return cls(
            used_bytes=pick("used_bytes", "used", "size_bytes", "current_size"),
            max_bytes=pick("max_bytes", "max_size", "limit_bytes", "capacity"),
            blob_count=pick("blob_count", "blobs", "cas_blobs"),
            ac_entries=pick("ac_entries", "action_entries", "ac_count"),
            evictions=pick("evictions", "evictions_total", "evicted"),
            oldest_item_age_seconds=pick("oldest_item_age_seconds", "lru_age_seconds", "oldest_age_seconds"),
        )


class _StorageCollector:
    """Gauges (and the evictions counter) read from the latest storage snapshot."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Any]:
        return list(self._families(StorageSnapshot(0, 0, 0, 0, 0, 0.0)))

    def collect(self) -> Iterable[Any]:
        return list(self._families(self._metrics.storage))

    @staticmethod
    def _families(s: StorageSnapshot) -> Iterable[Any]:
        gauges = (
            ("disk_used_bytes", "Bytes the local store holds now (CAS and action entries).", s.used_bytes),
            ("disk_max_bytes", "Size cap of the local store in bytes.", s.max_bytes),
            ("cas_blobs", "Number of CAS blobs in the local store.", s.blob_count),
            ("ac_entries", "Number of action cache entries (ActionResults and raw HTTP entries).", s.ac_entries),
            ("oldest_item_age_seconds", "Age of the least recently used item in the local store.",
             s.oldest_item_age_seconds),
        )  # fmt: skip
        for name, doc, value in gauges:
            if value is not None:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        if s.evictions is not None:
            yield CounterMetricFamily(
                f"{PREFIX}_evictions", "Items evicted from the local store to stay under its cap.", value=s.evictions
            )


def _field(stats: Any, name: str) -> Any:
    if stats is None:
        return None
    return stats.get(name) if isinstance(stats, Mapping) else getattr(stats, name, None)


def _labelled(counts: Any) -> list[tuple[str, float]]:
    """(label, value) pairs of a stats mapping, keys lowered; only bounded, name-like keys."""
    if not isinstance(counts, Mapping):
        return []
    pairs: list[tuple[str, float]] = []
    for key, value in counts.items():
        label = str(key).lower()
        if _STATS_LABEL.fullmatch(label) and isinstance(value, (int, float)) and len(pairs) < _MAX_STATS_LABELS:
            pairs.append((label, float(value)))
    return pairs


class _ObjectTierCollector:
    """The S3/OBS tier, read from `ObjectTier.stats()` at scrape time; nothing without a tier."""

    _EMPTY = {
        "healthy": True,
        "requests": {"head": 0},
        "corrupt_objects": 0,
        "presence_entries": 0,
        "cas": {"fast_hits": 0},
        "ac": {"fast_hits": 0},
        "journal": {"backlog": 0, "oldest_pending_age": 0.0, "uploads_ok": 0, "uploads_failed": 0,
                    "bytes_uploaded": 0, "in_flight": 0},
    }  # fmt: skip

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Any]:
        return list(self._families(self._EMPTY))

    def collect(self) -> Iterable[Any]:
        source = self._metrics.object_tier_stats
        if source is None:
            return []
        try:
            stats = source()
        except Exception:  # /metrics must answer even if the tier cannot tell
            log.warning("object tier stats failed", exc_info=True)
            return []
        return list(self._families(stats))

    @staticmethod
    def _families(stats: Any) -> Iterable[Any]:
        p = f"{PREFIX}_object_store"
        healthy = _field(stats, "healthy")
        if healthy is not None:
            yield GaugeMetricFamily(
                f"{p}_up", "1 while the object-store bucket is reachable; 0: local tier only, uploads wait.",
                value=1.0 if healthy else 0.0,
            )  # fmt: skip
        requests = CounterMetricFamily(
            f"{p}_requests", "Object-store API calls (not HTTP retries) by operation.", labels=["operation"]
        )
        for operation, value in _labelled(_field(stats, "requests")):
            requests.add_metric([operation], value)
        yield requests
        for name, doc, key, family in (
            ("corrupt_objects", "Bucket objects that failed verification (never served).", "corrupt_objects",
             CounterMetricFamily),
            ("presence_entries", "Digests in the local index of what the bucket holds (or lacks).",
             "presence_entries", GaugeMetricFamily),
        ):  # fmt: skip
            value = _field(stats, key)
            if value is not None:
                yield family(f"{p}_{name}", doc, value=float(value))
        events = CounterMetricFamily(
            f"{PREFIX}_object_tier_events",
            "What the tiered stores did: hits in the local (fast) or bucket (slow) tier, misses, "
            "backfills, skipped and lost uploads, reads refused while the bucket was down.",
            labels=["store", "event"],
        )
        for store in ("cas", "ac"):
            for event, value in _labelled(_field(stats, store)):
                events.add_metric([store, event], value)
        yield events
        journal = _field(stats, "journal")
        if journal is None:  # read-only or uploads off: this server never writes the bucket
            return
        j = f"{PREFIX}_upload_journal"
        for name, doc, key in (
            ("backlog", "Entries in the durable upload journal not uploaded to the bucket yet.", "backlog"),
            ("oldest_pending_age_seconds", "Age of the oldest entry waiting in the upload journal (0: none).",
             "oldest_pending_age"),
            ("in_flight", "Uploads from the journal in progress now.", "in_flight"),
        ):  # fmt: skip
            value = _field(journal, key)
            if value is not None:
                yield GaugeMetricFamily(f"{j}_{name}", doc, value=float(value))
        uploads = CounterMetricFamily(
            f"{p}_uploads", "Upload attempts from the journal to the bucket, by result.", labels=["result"]
        )
        for result, key in (("ok", "uploads_ok"), ("failed", "uploads_failed")):
            value = _field(journal, key)
            if value is not None:
                uploads.add_metric([result], float(value))
        yield uploads
        uploaded = _field(journal, "bytes_uploaded")
        if uploaded is not None:
            yield CounterMetricFamily(f"{p}_uploaded_bytes", "Bytes uploaded from the journal to the bucket.",
                                      value=float(uploaded))  # fmt: skip


class _ChunkingCollector:
    """Dedup at rest (storage/chunks), read from `ChunkedBlobStore.stats()` at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        source = self._metrics.chunking_stats
        if source is None:
            return []
        s = source()
        p = f"{PREFIX}_chunked"
        return [
            CounterMetricFamily(
                f"{p}_logical_bytes", "Bytes of blobs stored as chunks (as clients see them).", value=s["logical_bytes"]
            ),
            CounterMetricFamily(
                f"{p}_stored_bytes", "Chunk bytes those blobs added to the store (new chunks only).",
                value=s["stored_bytes"],
            ),  # fmt: skip
            GaugeMetricFamily(
                f"{p}_dedup_ratio", "Logical bytes per stored byte of the chunked blobs (1: nothing shared).",
                value=s["dedup_ratio"],
            ),  # fmt: skip
            GaugeMetricFamily(
                f"{p}_backlog_blobs", "Large blobs stored whole, waiting to be chunked.", value=s["backlog_blobs"]
            ),
            GaugeMetricFamily(
                f"{p}_backlog_bytes", "Bytes of the large blobs waiting to be chunked.", value=s["backlog_bytes"]
            ),
        ]


class _ExecutionCollector:
    """Remote execution, read from `ExecutionRuntime.status()` at scrape time; nothing without it."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        source = self._metrics.execution_status
        if source is None:
            return []
        return list(self._families(source()))

    @staticmethod
    def _families(s: dict[str, Any]) -> Iterable[Any]:
        p = f"{PREFIX}_execution"
        operations = CounterMetricFamily(
            f"{p}_operations", "Finished executions by outcome (ok, exit_nonzero, timeout, cancelled, "
            "unavailable, error) and Execute calls answered from the cache (cache_hit).", labels=["outcome"],
        )  # fmt: skip
        for name, value in sorted(s["outcomes"].items()):
            operations.add_metric([name], float(value))
        yield operations
        queue = GaugeMetricFamily(f"{p}_queue_length", "Jobs waiting for a worker, by pool.", labels=["pool"])
        oldest = GaugeMetricFamily(
            f"{p}_oldest_queued_age_seconds", "Age of the oldest waiting job, by pool (0: none).", labels=["pool"]
        )
        workers = GaugeMetricFamily(f"{p}_workers", "Workers by pool and state.", labels=["pool", "state"])
        for pool in s["pools"]:
            queue.add_metric([pool["pool"]], float(pool["queued"]))
            oldest.add_metric([pool["pool"]], float(pool["oldest_queued_age_seconds"]))
            for state in ("busy", "idle"):
                workers.add_metric([pool["pool"], state], float(pool[state]))
        yield from (queue, oldest, workers)
        for name, doc in (
            ("queue_seconds", "Seconds a job waited in the queue before a worker took it."),
            ("seconds", "Seconds from a worker taking a job to its end (inputs, run, outputs)."),
        ):
            timings = s["queue_seconds" if name == "queue_seconds" else "execution_seconds"]
            buckets = [("+Inf" if b == float("inf") else repr(b), float(n)) for b, n in timings["buckets"]]
            yield HistogramMetricFamily(f"{p}_{name}", doc, buckets=buckets, sum_value=timings["sum"])
        for name, doc, key in (
            ("retries", "Jobs sent back to the queue after their worker was lost.", "retries"),
            ("lost_workers", "Workers lost while running a job.", "lost_workers"),
            ("dedup_merges", "Execute calls that joined an identical action already in flight.", "dedup_merges"),
        ):
            yield CounterMetricFamily(f"{p}_{name}", doc, value=float(s[key]))
        sandbox = GaugeMetricFamily(f"{p}_sandbox", "Always 1; the sandbox actions run in.", labels=["sandbox"])
        sandbox.add_metric([s["sandbox"]], 1.0)
        yield sandbox


class Metrics:
    """The server's metrics and the few numbers /status shows, in one app-owned registry."""

    def __init__(self, registry: CollectorRegistry | None = None, version: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.started = time.time()
        self._started_monotonic = time.monotonic()
        self.storage = StorageSnapshot()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests handled, by protocol, method, kind and status.",
            ["protocol", "method", "kind", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Time from receiving a request to sending the last byte of its response.",
            ["protocol", "method", "kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ac_hits = Counter(
            f"{PREFIX}_ac_hits", "Action cache lookups that found an entry.", ["protocol"], registry=r
        )
        self.ac_misses = Counter(
            f"{PREFIX}_ac_misses", "Action cache lookups that found no (complete) entry.", ["protocol"], registry=r
        )
        self.cas_read_bytes = Counter(
            f"{PREFIX}_cas_read_bytes", "CAS blob bytes read for clients (before any zstd).", ["protocol"], registry=r
        )
        self.cas_written_bytes = Counter(
            f"{PREFIX}_cas_written_bytes",
            "CAS blob bytes received from clients and stored (after any zstd is decoded).",
            ["protocol"],
            registry=r,
        )
        # Access control (server/auth): reason is missing, malformed, unknown_scheme, bad_credentials,
        # no_client_certificate or denied.
        self.auth_refusals = Counter(
            f"{PREFIX}_auth_refusals",
            "Requests refused by access control, by reason.",
            ["protocol", "reason"],
            registry=r,
        )
        # Per-tier counts from the store boundary (storage.MeteredBlobStore/-ActionStore).
        self.store_calls = Counter(
            f"{PREFIX}_store_calls", "Calls into a store tier, by tier and operation (a batch is one call).",
            ["tier", "operation"], registry=r,
        )  # fmt: skip
        self.store_read_bytes = Counter(
            f"{PREFIX}_store_read_bytes", "Blob bytes read from a store tier.", ["tier"], registry=r
        )
        self.store_written_bytes = Counter(
            f"{PREFIX}_store_written_bytes", "Blob bytes written to a store tier.", ["tier"], registry=r
        )
        self.store_action_lookups = Counter(
            f"{PREFIX}_store_action_lookups", "Action entry lookups in a store tier, by result (hit, miss).",
            ["tier", "result"], registry=r,
        )  # fmt: skip
        # Several processes (server/processes/supervisor.py): store calls the primary served for each secondary
        # (process is its index, 1..N-1: a small fixed set).
        self.ipc_requests = Counter(
            f"{PREFIX}_store_ipc_requests", "Store calls served to a secondary server process, by its index.",
            ["process"], registry=r,
        )  # fmt: skip
        self.secondary_requests = Counter(
            f"{PREFIX}_secondary_requests", "Requests a secondary process served (in requests too), by index.",
            ["process"], registry=r,
        )  # fmt: skip
        # Remote Asset (buildvault.assets): result is hit, downloaded, miss, refused or checksum_mismatch.
        self.asset_fetches = Counter(
            f"{PREFIX}_asset_fetches", "Remote Asset fetches, by result.", ["result"], registry=r
        )
        self.asset_downloaded_bytes = Counter(
            f"{PREFIX}_asset_downloaded_bytes", "Bytes downloaded from asset origins.", registry=r
        )
        self.asset_stored = Counter(
            f"{PREFIX}_asset_stored", "Assets indexed by this server (downloaded or pushed).", registry=r
        )
        self.asset_results: dict[str, int] = {}  # the same counts, for /status
        self.assets_stored = 0
        start = Gauge(f"{PREFIX}_start_time_seconds", "Start time of the server, seconds since the epoch.", registry=r)
        start.set(self.started)
        info = Gauge(f"{PREFIX}_build_info", "Always 1; the version is a label.", ["version"], registry=r)
        info.labels(version=version or "unknown").set(1)
        self.version = version
        r.register(_StorageCollector(self))
        self.object_tier_stats: Callable[[], Any] | None = None
        r.register(_ObjectTierCollector(self))
        self.execution_status: Callable[[], dict[str, Any]] | None = None
        r.register(_ExecutionCollector(self))
        self.chunking_stats: Callable[[], dict[str, float]] | None = None
        r.register(_ChunkingCollector(self))
        # Plain tallies for /status (reading Counter values back is not public API).
        self._hits = {"grpc": 0, "http": 0}
        # (metric, label values) -> the labelled child. labels() takes a lock and builds its key on
        # every call (1.5 us of the 2 a counted call costs): each set is looked up once. The labels
        # come from fixed sets, so this stays small.
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._misses = {"grpc": 0, "http": 0}

    # -- recording ---------------------------------------------------------------------------
    def _child(self, metric: Any, *values: str) -> Any:
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def observe_request(self, protocol: str, method: str, kind: str, status: str | int, seconds: float) -> None:
        self._child(self.requests, protocol, method, kind, str(status)).inc()
        self._child(self.request_seconds, protocol, method, kind).observe(max(seconds, 0.0))

    def asset_fetch(self, result: str) -> None:
        self._child(self.asset_fetches, result).inc()
        self.asset_results[result] = self.asset_results.get(result, 0) + 1

    def asset_downloaded(self, nbytes: int) -> None:
        self.asset_downloaded_bytes.inc(nbytes)

    def asset_indexed(self) -> None:
        self.asset_stored.inc()
        self.assets_stored += 1

    def asset_summary(self) -> dict[str, Any]:
        """The status page's view: stored, fetches by result, hit ratio (None before any fetch)."""
        results = dict(self.asset_results)
        total = sum(results.values())
        ratio = round(results.get("hit", 0) / total, 4) if total else None
        return {"stored": self.assets_stored, "fetches": results, "hit_ratio": ratio}

    def ac_lookup(self, protocol: str, hit: bool) -> None:
        if hit:
            self._child(self.ac_hits, protocol).inc()
            self._hits[protocol] = self._hits.get(protocol, 0) + 1
        else:
            self._child(self.ac_misses, protocol).inc()
            self._misses[protocol] = self._misses.get(protocol, 0) + 1

    def cas_read(self, protocol: str, nbytes: int) -> None:
        if nbytes:
            self._child(self.cas_read_bytes, protocol).inc(nbytes)

    def cas_written(self, protocol: str, nbytes: int) -> None:
        if nbytes:
            self._child(self.cas_written_bytes, protocol).inc(nbytes)

    def auth_refused(self, protocol: str, reason: str) -> None:
        self._child(self.auth_refusals, protocol, reason).inc()

    def ipc_request(self, process: str) -> None:
        self._child(self.ipc_requests, process).inc()

    # -- the store boundary (storage.StoreRecorder) -------------------------------------
    # The client-facing tier's bytes also count per protocol, for the front end that named itself
    # in storage.REQUEST_PROTOCOL (the gRPC wrapper and the HTTP middleware do).

    def store_call(self, tier: str, operation: str) -> None:
        self._child(self.store_calls, tier, operation).inc()

    def store_read(self, tier: str, protocol: str | None, nbytes: int) -> None:
        self._child(self.store_read_bytes, tier).inc(nbytes)
        if tier == CLIENT_TIER and protocol is not None:
            self.cas_read(protocol, nbytes)

    def store_written(self, tier: str, protocol: str | None, nbytes: int) -> None:
        self._child(self.store_written_bytes, tier).inc(nbytes)
        if tier == CLIENT_TIER and protocol is not None:
            self.cas_written(protocol, nbytes)

    def store_action_lookup(self, tier: str, protocol: str | None, hit: bool) -> None:
        self._child(self.store_action_lookups, tier, "hit" if hit else "miss").inc()

    def set_storage(self, stats: Any) -> None:
        """Update the storage gauges from a store's stats() (see StorageSnapshot.from_stats)."""
        self.storage = StorageSnapshot.from_stats(stats)

    def watch_object_tier(self, stats: Callable[[], Any] | None) -> None:
        """Collect the S3/OBS tier's metrics from `stats()` (ObjectTier.stats) at every scrape."""
        self.object_tier_stats = stats

    def watch_chunking(self, stats: Callable[[], dict[str, float]] | None) -> None:
        """Collect dedup at rest's figures from `stats()` (ChunkedBlobStore.stats) at every scrape."""
        self.chunking_stats = stats

    def watch_execution(self, status: Callable[[], dict[str, Any]] | None) -> None:
        """Collect remote execution's metrics from `status()` (ExecutionRuntime.status) at every scrape."""
        self.execution_status = status

    # -- reading -----------------------------------------------------------------------------
    @property
    def uptime_seconds(self) -> float:
        return time.monotonic() - self._started_monotonic

    def ac_counts(self) -> dict[str, dict[str, int]]:
        """{"hits": {"grpc": n, "http": n, "total": n}, "misses": {...}} for /status."""
        hits = dict(self._hits, total=sum(self._hits.values()))
        misses = dict(self._misses, total=sum(self._misses.values()))
        return {"hits": hits, "misses": misses}

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST


def http_method_label(method: str) -> str:
    return method if method in HTTP_METHODS else "other"
