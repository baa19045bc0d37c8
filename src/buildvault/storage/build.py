"""One function turns Settings into the whole store stack (like bb-storage's
configuration/new_blob_access.go): which tiers exist, how they are wrapped, the process's role,
and what the process needs to know about them. Nothing else in the server builds a store.

    stack = await open_store_stack(settings, recorder, validate_entry=..., pins=...)  # the primary
    stack = await open_store_stack(settings, None, secondary=Secondary(socket, index, limit))
    stack.blobs, stack.actions      what the front ends serve
    stack.max_blob_size             0: no limit the clients must be told about
    stack.label                     one line for the start-up banner
    stack.local_stats / object_tier_stats   for /status and /metrics (None: nothing to show)
    stack.pins                      the golden versions' registry (None: not asked for)
    await stack.aclose()            closes in reverse order of opening

The primary's CAS stack, outermost first (every tier metered under its own name):

    MeteredBlobStore("client")
      EmptyBlobStore                        the empty blob is always present
        ChunkedBlobStore                    always: large blobs as FastCDC chunks + a chunk list
                                            (storage/chunks/); new ones only with settings.chunking;
                                            without a bucket, chunked after the write
          TieredBlobStore                   only with a bucket (storage/objectstore/)
            fast: MeteredBlobStore("local") > DiskBlobStore
            slow: MeteredBlobStore("object_store") > FailOpen > ExistenceCache > ObjectStore

and its action stack: PinningActionStore (when `pins` is given; WatchedPinningActionStore with a
bucket) > MeteredActionStore("client") >
TieredActionStore (only with a bucket; fast: MeteredActionStore("local") > DiskActionStore, slow:
MeteredActionStore("object_store") > FailOpenActionStore > ObjectStore).

Without a bucket the disk store sits right under the chunk store: the "client" meter is then
the only one (a second, identical "local" meter would cost a call per request and say nothing).
A read-only bucket (settings.s3_read_only) is the same stack without the journal, uploader and
last-use renewal. A secondary process (`--processes N`) opens no store of its own: its stack is
the primary's, over a private socket (storage/processes/client.py), where every call is served
and metered.

Stores handed in (tests: `App(blobs=..., actions=...)`) take the place of the local tier and
still get the rules (the empty blob) and the metrics.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from buildvault.config import Settings, format_size
from buildvault.digest import Digest
from buildvault.storage import (
    CLIENT_TIER,
    ActionStore,
    BlobStore,
    EmptyBlobStore,
    MeteredActionStore,
    MeteredBlobStore,
    StorageError,
    StoreRecorder,
)
from buildvault.storage.chunks import ChunkedBlobStore
from buildvault.storage.chunks.store import NAMESPACE as CHUNK_LISTS
from buildvault.storage.fail_open import FailOpenActionStore, FailOpenBlobStore, SlowTierHealth
from buildvault.storage.objectstore.journal import UploadJournal
from buildvault.storage.objectstore.last_use import LastUseRefresher
from buildvault.storage.objectstore.presence import ExistenceCache, PresenceIndex
from buildvault.storage.objectstore.tier import ObjectTier
from buildvault.storage.objectstore.tiered import TieredActionStore, TieredBlobStore
from buildvault.storage.processes.client import RemoteStoreClient

if TYPE_CHECKING:
    from buildvault.storage.objectstore.store import ObjectStore

LOCAL_TIER = "local"
OBJECT_STORE_TIER = "object_store"

# Replaces the set of blobs and action entries (namespace, digest) the local tier must never evict.
Protector = Callable[[Iterable[Digest], Iterable[tuple[str, Digest]]], None]
# Checks an action entry re-read after an unclean stop: (kind "ac" or "raw", bytes) -> intact?
EntryValidator = Callable[[str, bytes], bool]


class PinLayer(Protocol):
    """Golden versions (server/pins.py's PinRegistry): which entries the local tier's eviction
    keeps. Handed in as a factory, like `EntryValidator`: storage parses no REAPI message."""

    def wrap(self, actions: ActionStore, watched: bool) -> ActionStore:
        """The action store that tells the layer of every pin index written through it, and, when
        `watched` (it will follow a bucket), of every namespace asked about."""

    async def load(self, actions: ActionStore, namespaces: Iterable[str]) -> None:
        """Read the pin indexes of `namespaces` (at start-up, from the local tier)."""

    def watch(self, bucket: ActionStore, local: ActionStore, interval: float) -> Callable[[], Awaitable[None]]:
        """Follow the pins other servers set in the bucket; returns what stops it."""

    def listing(self) -> list[dict[str, str]]:
        """Every pin, for the status page."""


# What else a pinned blob needs kept when it is kept as chunks: (its chunks, its chunk list's
# action entry); nothing for a blob kept whole.
ChunkParts = Callable[[Digest], Awaitable[tuple[list[Digest], list[tuple[str, Digest]]]]]
# Makes the pin layer over the stack's blobs, the local tier's protector and the chunk parts.
PinFactory = Callable[[BlobStore, Protector, ChunkParts], PinLayer]


@dataclass(frozen=True)
class Secondary:
    """This process is secondary server process `index`: its store is the primary's, reached
    over the private socket `socket`; `max_blob_size` is the primary's limit."""

    socket: str
    index: int
    max_blob_size: int = 0


def _protect_nothing(blobs: Iterable[Digest], actions: Iterable[tuple[str, Digest]]) -> None:
    """A store with no eviction (given stores): there is nothing to protect."""


class StackError(RuntimeError):
    """The store stack could not be opened (the data directory is locked, unreadable, ...)."""


@dataclass
class StoreStack:
    """The opened stack and what the process needs to know about it."""

    blobs: BlobStore
    actions: ActionStore
    label: str
    max_blob_size: int = 0
    local_stats: Callable[[], Any] | None = None
    protect: Protector = _protect_nothing  # pinned versions: what the local tier's eviction skips
    namespaces: Callable[[], Awaitable[list[str]]] | None = None  # the local tier's AC namespaces
    local_actions: ActionStore | None = None  # the local tier alone (start-up reads that must not wait on a bucket)
    discard: Callable[[Digest], Awaitable[None]] | None = None  # drops a blob from the disk tier
    object_tier: ObjectTier | None = None
    chunks: ChunkedBlobStore | None = None  # the chunk store (SplitBlob/SpliceBlob); None: chunking off
    pins: PinLayer | None = None
    remote: RemoteStoreClient | None = None  # a secondary's connection to the primary's store
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    @property
    def object_tier_stats(self) -> Callable[[], dict[str, Any]] | None:
        return self.object_tier.stats if self.object_tier is not None else None

    async def aclose(self) -> None:
        """Close every tier, last opened first; one failing does not keep the others open."""
        closers, self.closers = self.closers, []
        errors: list[BaseException] = []
        for close in reversed(closers):
            try:
                await close()
            except Exception as exc:  # keep closing the rest
                errors.append(exc)
        if errors:
            raise errors[0]


async def open_store_stack(
    settings: Settings,
    recorder: StoreRecorder | None,
    *,
    secondary: Secondary | None = None,
    blobs: BlobStore | None = None,
    actions: ActionStore | None = None,
    validate_entry: EntryValidator | None = None,
    pins: PinFactory | None = None,
    **tier_options: Any,
) -> StoreStack:
    """Open the stack Settings describe (or wrap the given stores); raise StackError if it cannot be opened.

    `recorder` meters every tier (None: no meters). `secondary`: this process is a secondary and
    its stack is the primary's. `validate_entry` is how the disk store re-checks action entries
    after an unclean stop (the ActionCache semantics hand it in: storage parses no REAPI
    messages); `pins`, likewise handed in, makes the golden versions' layer. `tier_options`
    reach `build_object_tier` (tests shorten its timeouts)."""
    if secondary is not None:
        client = RemoteStoreClient(secondary.socket, secondary.index)
        return StoreStack(
            client.blobs,
            client.actions,
            label=f"the primary's store at {secondary.socket}",
            max_blob_size=secondary.max_blob_size,
            remote=client,
            closers=[client.aclose],
        )
    if blobs is not None and actions is not None:
        stack = StoreStack(blobs, actions, label=f"given ({type(blobs).__name__})")
    else:
        stack = await _open_disk(settings, validate_entry)
    try:
        stack.local_actions = stack.actions
        if settings.s3_bucket and recorder is not None:  # without a bucket the client meter is the local tier's
            local_blobs: BlobStore = MeteredBlobStore(stack.blobs, recorder, LOCAL_TIER)
            local_actions: ActionStore = MeteredActionStore(stack.actions, recorder, LOCAL_TIER)
            stack.blobs, stack.actions = local_blobs, local_actions
            stack.local_actions = local_actions
        tier = build_object_tier(settings, stack.blobs, stack.actions, recorder=recorder, **tier_options)
        if tier is not None:
            stack.closers.append(tier.aclose)
            await tier.start()
            stack.object_tier = tier
            stack.blobs, stack.actions = tier.cas, tier.ac
            stack.label += f" + bucket {settings.s3_bucket} at {settings.s3_endpoint or 'AWS'}"
    except BaseException as exc:
        await stack.aclose()
        if isinstance(exc, (OSError, StorageError)):
            raise StackError(f"cannot open the object-store tier: {exc}") from exc
        raise
    # Always in the stack: with chunking off new blobs go whole, but blobs kept as chunks while it
    # was on are still served. Only with it on are SplitBlob/SpliceBlob offered (stack.chunks).
    chunked = ChunkedBlobStore(
        stack.blobs,
        stack.actions,
        threshold=settings.chunking_threshold,
        chunk_writes=settings.chunking,
        discard=stack.discard if stack.object_tier is None else None,  # a bucket's whole copy is shared
        backlog=settings.chunking_backlog,
    )
    stack.closers.append(chunked.aclose)
    stack.chunks = chunked if settings.chunking else None
    stack.blobs = chunked
    stack.blobs = EmptyBlobStore(stack.blobs)
    if recorder is not None:
        stack.blobs = MeteredBlobStore(stack.blobs, recorder, CLIENT_TIER)
        stack.actions = MeteredActionStore(stack.actions, recorder, CLIENT_TIER)
    if pins is not None:
        try:
            await _add_pins(stack, settings, pins, _chunk_parts(chunked))
        except BaseException:
            await stack.aclose()
            raise
    return stack


def _chunk_parts(chunked: ChunkedBlobStore) -> ChunkParts:
    async def parts(digest: Digest) -> tuple[list[Digest], list[tuple[str, Digest]]]:
        if digest.size_bytes < chunked.threshold:
            return [], []
        chunks = await chunked.chunk_list(digest)
        return ([], []) if chunks is None else (chunks, [(CHUNK_LISTS, digest)])

    return parts


async def _add_pins(stack: StoreStack, settings: Settings, pins: PinFactory, chunk_parts: ChunkParts) -> None:
    """The pin layer outermost on the action side; the pin indexes read before anyone is served."""
    layer = stack.pins = pins(stack.blobs, stack.protect, chunk_parts)
    stack.actions = layer.wrap(stack.actions, watched=stack.object_tier is not None)
    # Start-up reads every instance's pin index from the local tier (never waiting on, or
    # counting a miss in, the bucket); pins set through other servers come from the bucket later.
    namespaces = await stack.namespaces() if stack.namespaces is not None else ["ac"]
    local = stack.local_actions or stack.actions
    await layer.load(local, namespaces)
    if stack.object_tier is not None:
        stack.closers.append(layer.watch(stack.object_tier.ac.slow, local, settings.pins_refresh))


async def _open_disk(settings: Settings, validate_entry: EntryValidator | None) -> StoreStack:
    from buildvault.storage.disk import DiskStorage

    directory = settings.dir
    try:
        storage = await DiskStorage.open(
            directory, settings.max_size, validate_entry=validate_entry, hold_seconds=settings.eviction_hold
        )
    except (OSError, StorageError) as exc:
        raise StackError(f"cannot open the data directory {directory}: {exc}") from None
    return StoreStack(
        storage.cas,
        storage.ac,
        label=f"disk {directory} (max {format_size(settings.max_size)})",
        max_blob_size=settings.max_size,  # no blob larger than the whole cache can be stored
        local_stats=storage.stats,
        protect=storage.protect,
        namespaces=storage.namespaces,
        discard=storage.cas.discard,
        closers=[storage.close],
    )


def build_object_tier(
    settings: Settings,
    fast_cas: BlobStore,
    fast_ac: ActionStore,
    data_dir: str | Path | None = None,
    *,
    object_store: ObjectStore | None = None,
    recorder: StoreRecorder | None = None,
    timeout: float = 10.0,
    budget: float | None = None,
    journal_options: dict[str, Any] | None = None,
    health_options: dict[str, Any] | None = None,
    presence: PresenceIndex | None = None,
    uploads: bool = True,
    head_concurrency: int = 32,
    **store_options: Any,
) -> ObjectTier | None:
    """The bucket tier in front of `fast_cas` / `fast_ac`, or None when no bucket is configured.

    The slow side is composed from one-behaviour decorators, outermost first:

        MeteredBlobStore("object_store")        per-tier metrics (if a recorder is given)
          FailOpenBlobStore(health, budget)     unavailable = Unavailable, fast; probes while down
            ExistenceCache(PresenceIndex)       FindMissingBlobs without per-digest HEADs
              ObjectStore                       the bucket (boto3 off the event loop)

    and the action side is MeteredActionStore(FailOpenActionStore(ObjectStore)). A server that
    writes the bucket also renews the last use of the entries it serves (objectstore/last_use.py),
    so `buildvault gc` never ages out an entry builds still hit.

    The journal lives in `{data_dir or settings.dir}/upload-journal`. Read-only
    (settings.s3_read_only) consumes the bucket and never writes it (no journal at all);
    `uploads=False` likewise keeps this server from uploading. `budget` (default
    settings.s3_request_budget) bounds bucket checks on a request path. Call `await tier.start()`."""
    if not settings.s3_bucket:
        return None
    from buildvault.storage.objectstore.store import ObjectStore

    store = object_store or ObjectStore.from_settings(settings, head_concurrency=head_concurrency, **store_options)
    read_only = settings.s3_read_only or store.read_only
    health = SlowTierHealth(store.probe, name=f"object store bucket {store.bucket}", **(health_options or {}))
    budget = settings.s3_request_budget if budget is None else budget
    journal = None
    if not read_only and uploads:
        directory = Path(data_dir if data_dir is not None else settings.dir) / "upload-journal"
        journal = UploadJournal(directory, **(journal_options or {}))
    cache = ExistenceCache(store, presence)
    slow_cas: BlobStore = FailOpenBlobStore(cache, health, budget=budget, timeout=timeout, parallel=head_concurrency)
    slow_ac: ActionStore = FailOpenActionStore(store, health, budget=budget, timeout=timeout)
    if recorder is not None:
        slow_cas = MeteredBlobStore(slow_cas, recorder, OBJECT_STORE_TIER)
        slow_ac = MeteredActionStore(slow_ac, recorder, OBJECT_STORE_TIER)
    cas = TieredBlobStore(
        fast_cas, slow_cas, journal, known_in_slow=cache.known_present, read_only=read_only, uploads=uploads
    )
    last_use = None if read_only or not uploads else LastUseRefresher(store.refresh_entry, lambda: health.healthy)
    served = last_use.served if last_use is not None else None
    ac = TieredActionStore(fast_ac, slow_ac, journal, read_only=read_only, uploads=uploads, served=served)
    return ObjectTier(store, cas, ac, journal, health, cache, last_use)
