"""Merkle trees of REAPI Directory messages with files and symlinks (input roots, output Trees).

`TreeBuilder.add_file` / `add_symlink` take '/'-separated paths relative to the tree's root;
`root()` serializes every Directory deterministically (sorted names), so the same entries
always give the same digests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

from ..keys import serialize


@dataclass
class _Dir:
    files: dict[str, tuple[Digest, bool]] = field(default_factory=dict)
    links: dict[str, tuple[str, list[tuple[str, str]]]] = field(default_factory=dict)
    dirs: dict[str, _Dir] = field(default_factory=dict)


class TreeBuilder:
    def __init__(self) -> None:
        self._top = _Dir()

    def _parent(self, path: str) -> tuple[_Dir, str]:
        parts = path.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"not a clean relative path: {path!r}")
        node = self._top
        for part in parts[:-1]:
            node = node.dirs.setdefault(part, _Dir())
        return node, parts[-1]

    def add_file(self, path: str, digest: Digest, executable: bool) -> None:
        node, name = self._parent(path)
        node.files[name] = (digest, executable)

    def add_symlink(self, path: str, target: str, properties: list[tuple[str, str]] | None = None) -> None:
        node, name = self._parent(path)
        node.links[name] = (target, list(properties or []))

    def add_dir(self, path: str) -> None:
        """An (possibly empty) directory."""
        node, name = self._parent(path)
        node.dirs.setdefault(name, _Dir())

    def _message(self, node: _Dir, out: dict[Digest, bytes], children: list[re_pb2.Directory]) -> re_pb2.Directory:
        subdirs = []
        for name in sorted(node.dirs):
            sub = self._message(node.dirs[name], out, children)
            data = serialize(sub)
            digest = Digest.of(data)
            if digest not in out:
                children.append(sub)
            out[digest] = data
            subdirs.append(re_pb2.DirectoryNode(name=name, digest=digest.to_proto(re_pb2.Digest)))
        links = []
        for name in sorted(node.links):
            target, props = node.links[name]
            link = re_pb2.SymlinkNode(name=name, target=target)
            if props:
                link.node_properties.properties.extend(re_pb2.NodeProperty(name=k, value=v) for k, v in sorted(props))
            links.append(link)
        return re_pb2.Directory(
            files=[
                re_pb2.FileNode(name=n, digest=d.to_proto(re_pb2.Digest), is_executable=x)
                for n, (d, x) in sorted(node.files.items())
            ],
            directories=subdirs,
            symlinks=links,
        )

    def root(self) -> tuple[Digest, dict[Digest, bytes]]:
        """The root Directory's digest and every Directory blob by digest."""
        blobs: dict[Digest, bytes] = {}
        top = self._message(self._top, blobs, [])
        data = serialize(top)
        digest = Digest.of(data)
        blobs[digest] = data
        return digest, blobs

    def tree(self) -> re_pb2.Tree:
        """The whole hierarchy as one REAPI Tree message (what an OutputDirectory names)."""
        children: list[re_pb2.Directory] = []
        top = self._message(self._top, {}, children)
        return re_pb2.Tree(root=top, children=children)
