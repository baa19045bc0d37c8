"""The server's view of golden versions: which entries eviction must keep.

Clients write pins as an ordinary ActionResult under the fixed pin-index key (buildvault/pins.py),
one per instance. The registry hands the protector every blob a pin reaches (each pinned Tree,
every file and Directory it names, a pinned directory asset's root Directory, the `.key` blobs,
each pinned asset's content; of a blob kept as chunks, its chunks and its chunk list) and the
action entries to keep (the index itself, each pinned artifact's entry, each pinned asset's index
entries). It learns a pin index three ways:
- at start-up, from the local tier, for every instance that has entries there (`load`);
- when one is written through this server, for any instance (`PinningActionStore.put`);
- with a bucket, every `pins_refresh` seconds from the bucket, for every instance known here
  (on disk, or asked about since start-up: `WatchedPinningActionStore`): pins set through
  another server (`PinWatcher`).
A pin index that cannot be read protects nothing new and never fails a write. The registry is
the stack's `PinLayer` (storage/build.py puts it in: `open_store_stack(..., pins=PinRegistry)`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from buildvault import pins
from buildvault.actions import read_blob
from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.remote_apis import re_pb2
from buildvault.storage import ActionStore, BlobStore, ForwardingActionStore, NotFound, StorageError

if TYPE_CHECKING:
    from buildvault.storage.build import ChunkParts

log = logging.getLogger(__name__)

Protector = Callable[[Iterable[Digest], Iterable[tuple[str, Digest]]], None]
MAX_TREE_BYTES = 64 << 20
MAX_ENTRIES_BYTES = 64 << 10  # an asset pin's `.entries` blob: a few lines
MAX_WATCHED = 1000  # instances whose pin index is read from the bucket each round (one GET each)


def _digest(message: re_pb2.Digest) -> Digest | None:
    try:
        return Digest.from_proto(message, DigestFunction.SHA256)
    except InvalidDigest:
        return None


class PinRegistry:
    def __init__(self, blobs: BlobStore, protect: Protector, chunk_parts: ChunkParts | None = None) -> None:
        self.blobs = blobs
        self.protect = protect
        self.chunk_parts = chunk_parts  # a pinned blob kept as chunks: its chunks and chunk list
        self.indexes: dict[str, re_pb2.ActionResult] = {}  # AC namespace -> pin index
        self.raw: dict[str, bytes] = {}  # AC namespace -> the pin index as stored
        self.known: set[str] = set()  # kind-"ac" namespaces this server has seen: where pins may be
        self.pinned_blobs: set[Digest] = set()
        self.pinned_actions: set[tuple[str, Digest]] = set()

    def seen(self, namespace: str) -> None:
        if namespace in self.known or len(self.known) >= MAX_WATCHED:
            return
        if namespace == "ac" or namespace.startswith("ac/"):
            self.known.add(namespace)

    def _parse(self, namespace: str, data: bytes) -> bool:
        index = re_pb2.ActionResult()
        try:
            index.ParseFromString(data)
        except DecodeError:
            return False
        self.seen(namespace)
        self.indexes[namespace], self.raw[namespace] = index, bytes(data)
        return True

    async def learn(self, namespace: str, data: bytes) -> None:
        if self._parse(namespace, data):
            await self._apply()

    async def _tree_blobs(self, digest: Digest) -> set[Digest]:
        try:
            tree = re_pb2.Tree()
            tree.ParseFromString(await read_blob(self.blobs, digest, MAX_TREE_BYTES))
        except (NotFound, DecodeError, ValueError):
            return {digest}
        out = {digest}
        for directory in [tree.root, *tree.children]:
            # Files, and the Directory blobs below the root: FetchDirectory and GetTree of a
            # pinned directory asset read them (an artifact's Tree names Directories nobody stores).
            for digest_message in [*(n.digest for n in directory.files), *(n.digest for n in directory.directories)]:
                d = _digest(digest_message)
                if d is not None:
                    out.add(d)
        return out

    async def _apply(self) -> None:
        blobs: set[Digest] = set()
        actions: set[tuple[str, Digest]] = set()
        for namespace, index in self.indexes.items():
            actions.add((namespace, pins.INDEX_DIGEST))
            for output in index.output_directories:  # artifact pins and directory asset pins
                d = _digest(output.tree_digest)
                if d is not None:
                    blobs |= await self._tree_blobs(d)
                root = _digest(output.root_directory_digest)  # None when unset (an artifact's)
                if root is not None:
                    blobs.add(root)
            for f in index.output_files:
                d = _digest(f.digest)
                if d is not None:
                    blobs.add(d)
            for key_blob in pins.key_blobs(index):
                d = _digest(key_blob)
                try:
                    key = pins.parse_artifact_key(await read_blob(self.blobs, d, 1024)) if d else None
                    if key is not None:
                        actions.add((namespace, Digest.parse(*key, DigestFunction.SHA256)))
                except (NotFound, ValueError):
                    continue
            actions |= await self._asset_entries(namespace, index)
        if self.chunk_parts is not None:
            for blob in list(blobs):
                try:
                    chunks, entries = await self.chunk_parts(blob)
                except StorageError:
                    continue
                blobs.update(chunks)
                actions.update(entries)
        self.pinned_blobs, self.pinned_actions = blobs, actions
        self.protect(blobs, actions)

    async def _asset_entries(self, namespace: str, index: re_pb2.ActionResult) -> set[tuple[str, Digest]]:
        """The asset index entries the index's asset pins keep (their content blobs are output
        files of the index, kept with the others)."""
        out: set[tuple[str, Digest]] = set()
        for entries_blob in pins.asset_entry_blobs(index):
            d = _digest(entries_blob)
            try:
                data = await read_blob(self.blobs, d, MAX_ENTRIES_BYTES) if d else b""
            except (NotFound, ValueError):
                continue
            for function, hash_, size in pins.parse_asset_entries(data):
                try:
                    key = Digest.parse(hash_, size, DigestFunction.from_label(function))
                except InvalidDigest:
                    continue
                out.add((pins.asset_namespace(namespace), key))
        return out

    async def load(self, actions: ActionStore, namespaces: Iterable[str] = ("ac",)) -> None:
        """Read the pin index of each kind-"ac" namespace in `namespaces` at start-up."""
        for namespace in namespaces:
            self.seen(namespace)
        for namespace in sorted(self.known):
            try:
                self._parse(namespace, await actions.get(namespace, pins.INDEX_DIGEST))
            except NotFound:
                continue
        await self._apply()

    async def refresh(self, source: ActionStore, local: ActionStore) -> int:
        """Read every known namespace's pin index from `source` (the bucket); apply and keep locally
        those that changed. Returns how many changed; a namespace the bucket cannot answer is skipped."""
        changed = 0
        for namespace in sorted(self.known):
            try:
                data = await source.get(namespace, pins.INDEX_DIGEST)
            except StorageError:  # not there (NotFound), or the bucket is down: next round
                continue
            if data == self.raw.get(namespace) or not self._parse(namespace, data):
                continue
            changed += 1
            try:  # so a client reading the index through this server sees the current one
                await local.put(namespace, pins.INDEX_DIGEST, data)
            except StorageError as e:
                log.warning("could not keep the pin index of %s locally: %s", namespace, e)
        if changed:
            await self._apply()
        return changed

    def wrap(self, actions: ActionStore, watched: bool) -> ActionStore:
        """`actions`, telling this registry of every pin index written through it; `watched` (a
        bucket is followed), of every namespace asked about too."""
        return WatchedPinningActionStore(actions, self) if watched else PinningActionStore(actions, self)

    def watch(self, source: ActionStore, local: ActionStore, interval: float) -> Callable[[], Awaitable[None]]:
        """Start refreshing from `source` (the bucket) every `interval` seconds; returns what stops it."""
        watcher = PinWatcher(self, source, local, interval)
        watcher.start()
        return watcher.aclose

    def listing(self) -> list[dict[str, str]]:
        """Every pin, for the status page: instance namespace, artifact name, label, Tree digest;
        an asset pin's name is `assets` and it has the asset's `blob` digest instead (a directory
        asset's root Directory, and its `tree` too)."""
        out = []
        for namespace, index in sorted(self.indexes.items()):
            for path, tree in sorted(pins.pinned_trees(index).items()):
                name, _, label = path.partition("/")
                out.append({"namespace": namespace, "name": name, "label": label,
                            "tree": f"{tree.hash}/{tree.size_bytes}"})
            trees = pins.pinned_asset_trees(index)
            for label, blob in sorted(pins.pinned_assets(index).items()):
                pin = {"namespace": namespace, "name": pins.ASSET_DIR, "label": label,
                       "blob": f"{blob.hash}/{blob.size_bytes}"}
                if label in trees:  # a directory: `blob` is its root Directory
                    pin["tree"] = f"{trees[label].hash}/{trees[label].size_bytes}"
                out.append(pin)
        return out


class PinningActionStore(ForwardingActionStore):
    """Forwards everything; a pin index written through it updates the registry."""

    def __init__(self, inner: ActionStore, registry: PinRegistry) -> None:
        super().__init__(inner)
        self.registry = registry

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        await self.inner.put(namespace, digest, data)
        self.registry.seen(namespace)
        if digest == pins.INDEX_DIGEST and (namespace == "ac" or namespace.startswith("ac/")):
            try:
                await self.registry.learn(namespace, data)
            except Exception:  # a pin bookkeeping failure must not fail the write
                log.warning("could not apply the pin index of %s", namespace, exc_info=True)


class WatchedPinningActionStore(PinningActionStore):
    """With a bucket followed: also notes each namespace asked about, whose pin index the watcher
    then reads (pins another server set for an instance this one serves). Without a bucket no
    one reads those notes, so reads pass the plain PinningActionStore untouched."""

    async def get(self, namespace: str, digest: Digest) -> bytes:
        self.registry.seen(namespace)  # a set lookup
        return await self.inner.get(namespace, digest)


class PinWatcher:
    """Every `interval` seconds, `registry.refresh` from the bucket: pins set through other servers."""

    def __init__(self, registry: PinRegistry, source: ActionStore, local: ActionStore, interval: float) -> None:
        self.registry, self.source, self.local, self.interval = registry, source, local, interval
        self.rounds = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.registry.refresh(self.source, self.local)
            except Exception:  # keep watching: the next round may succeed
                log.warning("could not refresh the pin indexes from the bucket", exc_info=True)
            self.rounds += 1

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
