"""The server's view of golden versions: which entries eviction must keep.

Clients write pins as an ordinary ActionResult under the fixed pin-index key (buildvault/pins.py).
`PinningActionStore` sees that entry pass through `put` (and reads it back at start-up), and
hands the protector every blob a pin reaches (each pinned Tree, every file and directory in it,
the `.key` blobs) and the action entries to keep (the index itself and each pinned artifact's
entry). A pin index that cannot be read protects nothing new and never fails the write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from google.protobuf.message import DecodeError

from buildvault import pins
from buildvault.actions import read_blob
from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.remote_apis import re_pb2
from buildvault.storage import ActionStore, BlobStore, NotFound, ac_namespace
from buildvault.storage.decorator import ForwardingActionStore

log = logging.getLogger(__name__)

Protector = Callable[[Iterable[Digest], Iterable[tuple[str, Digest]]], None]
MAX_TREE_BYTES = 64 << 20


def _digest(message: re_pb2.Digest) -> Digest | None:
    try:
        return Digest.from_proto(message, DigestFunction.SHA256)
    except InvalidDigest:
        return None


class PinRegistry:
    def __init__(self, blobs: BlobStore, protect: Protector) -> None:
        self.blobs = blobs
        self.protect = protect
        self.indexes: dict[str, re_pb2.ActionResult] = {}  # AC namespace -> pin index
        self.pinned_blobs: set[Digest] = set()
        self.pinned_actions: set[tuple[str, Digest]] = set()

    async def learn(self, namespace: str, data: bytes) -> None:
        index = re_pb2.ActionResult()
        try:
            index.ParseFromString(data)
        except DecodeError:
            return
        self.indexes[namespace] = index
        await self._apply()

    async def _tree_blobs(self, digest: Digest) -> set[Digest]:
        try:
            tree = re_pb2.Tree()
            tree.ParseFromString(await read_blob(self.blobs, digest, MAX_TREE_BYTES))
        except (NotFound, DecodeError, ValueError):
            return {digest}
        out = {digest}
        for directory in [tree.root, *tree.children]:
            for f in directory.files:
                d = _digest(f.digest)
                if d is not None:
                    out.add(d)
        return out

    async def _apply(self) -> None:
        blobs: set[Digest] = set()
        actions: set[tuple[str, Digest]] = set()
        for namespace, index in self.indexes.items():
            actions.add((namespace, pins.INDEX_DIGEST))
            for tree in pins.pinned_trees(index).values():
                d = _digest(tree)
                if d is not None:
                    blobs |= await self._tree_blobs(d)
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
        self.pinned_blobs, self.pinned_actions = blobs, actions
        self.protect(blobs, actions)

    async def load(self, actions: ActionStore, instances: Iterable[str] = ("",)) -> None:
        """Read the pin indexes of `instances` at start-up."""
        for instance in instances:
            namespace = ac_namespace(instance)
            try:
                data = await actions.get(namespace, pins.INDEX_DIGEST)
            except NotFound:
                continue
            index = re_pb2.ActionResult()
            try:
                index.ParseFromString(data)
            except DecodeError:
                continue
            self.indexes[namespace] = index
        await self._apply()

    def listing(self) -> list[dict[str, str]]:
        """Every pin, for the status page: instance namespace, artifact name, label, Tree digest."""
        out = []
        for namespace, index in sorted(self.indexes.items()):
            for path, tree in sorted(pins.pinned_trees(index).items()):
                name, _, label = path.partition("/")
                out.append({"namespace": namespace, "name": name, "label": label,
                            "tree": f"{tree.hash}/{tree.size_bytes}"})
        return out


class PinningActionStore(ForwardingActionStore):
    """Forwards everything; a pin index written through it updates the registry."""

    def __init__(self, inner: ActionStore, registry: PinRegistry) -> None:
        super().__init__(inner)
        self.registry = registry

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        await self.inner.put(namespace, digest, data)
        if digest == pins.INDEX_DIGEST and (namespace == "ac" or namespace.startswith("ac/")):
            try:
                await self.registry.learn(namespace, data)
            except Exception:  # a pin bookkeeping failure must not fail the write
                log.warning("could not apply the pin index of %s", namespace, exc_info=True)
