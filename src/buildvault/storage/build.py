"""One function turns Settings into the whole store stack (like bb-storage's
configuration/new_blob_access.go): which tiers exist, how they are wrapped, and what the
process needs to know about them. Nothing else in the server chooses storage behaviour.

    stack = await open_store_stack(settings, recorder)
    stack.blobs, stack.actions      what the front ends serve
    stack.max_blob_size             0: no limit the clients must be told about
    stack.label                     one line for the start-up banner
    stack.local_stats / object_tier_stats   for /status and /metrics (None: nothing to show)
    await stack.aclose()            closes in reverse order of opening

The CAS stack, outermost first (every tier metered under its own name):

    MeteredBlobStore("client")
      EmptyBlobStore                        the empty blob is always present
       ChunkedBlobStore                     large blobs as FastCDC chunks + a chunk list (storage/chunks/)
        TieredBlobStore                     only with a bucket (storage/objectstore/tier.py)
          fast: MeteredBlobStore("local") > DiskBlobStore
          slow: MeteredBlobStore("object_store") > FailOpen > ExistenceCache > ObjectStore

Without a bucket the disk store sits right under EmptyBlobStore: the "client" meter is then
the only one (a second, identical "local" meter would cost a call per request and say nothing).

Stores handed in (tests: `App(blobs=..., actions=...)`) take the place of the local tier and
still get the rules (the empty blob) and the metrics.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from buildvault.config import Settings, format_size
from buildvault.digest import Digest
from buildvault.storage import ActionStore, BlobStore, StorageError
from buildvault.storage.chunks import ChunkedBlobStore
from buildvault.storage.empty_blob import EmptyBlobStore
from buildvault.storage.metrics import CLIENT_TIER, MeteredActionStore, MeteredBlobStore, StoreRecorder
from buildvault.storage.objectstore.tier import ObjectTier, build_object_tier

LOCAL_TIER = "local"

# Replaces the set of blobs and action entries (namespace, digest) the local tier must never evict.
Protector = Callable[[Iterable[Digest], Iterable[tuple[str, Digest]]], None]
# Checks an action entry re-read after an unclean stop: (kind "ac" or "raw", bytes) -> intact?
EntryValidator = Callable[[str, bytes], bool]


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
    object_tier: ObjectTier | None = None
    chunks: ChunkedBlobStore | None = None  # the chunk store (SplitBlob/SpliceBlob); None: chunking off
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
    recorder: StoreRecorder,
    *,
    blobs: BlobStore | None = None,
    actions: ActionStore | None = None,
    validate_entry: EntryValidator | None = None,
    **tier_options: Any,
) -> StoreStack:
    """Open the stack Settings describe (or wrap the given stores); raise StackError if it cannot be opened.

    `validate_entry` is how the disk store re-checks action entries after an unclean stop (the
    ActionCache semantics hand it in: storage parses no REAPI messages). `tier_options` reach
    `build_object_tier` (tests shorten its timeouts)."""
    if blobs is not None and actions is not None:
        stack = StoreStack(blobs, actions, label=f"given ({type(blobs).__name__})")
    else:
        stack = await _open_disk(settings, validate_entry)
    try:
        stack.local_actions = stack.actions
        if settings.s3_bucket:  # without a bucket the client meter is the local tier's: one meter per call
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
    if settings.chunking:
        stack.chunks = ChunkedBlobStore(stack.blobs, stack.actions, threshold=settings.chunking_threshold)
        stack.blobs = stack.chunks
    stack.blobs = MeteredBlobStore(EmptyBlobStore(stack.blobs), recorder, CLIENT_TIER)
    stack.actions = MeteredActionStore(stack.actions, recorder, CLIENT_TIER)
    return stack


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
        closers=[storage.close],
    )

