"""Materialise an action's input root from the CAS into a directory.

Directories are fetched one tree level per request batch, then every file once (a blob used by
several paths is downloaded once and written to each). Paths come from the Directory messages,
so every name is checked: no `..`, no `/`, nothing that escapes the action directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2


class InputError(Exception):
    """The input root cannot be materialised (a blob is missing, a name is unsafe)."""


class BlobSource(Protocol):
    def download(self, digests: list[Digest]) -> dict[Digest, bytes]: ...


def _name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise InputError(f"unsafe name in the input root: {name!r}")
    return name


def _digest(message: re_pb2.Digest) -> Digest:
    return Digest.from_proto(message)


def fetch_tree(source: BlobSource, root: Digest) -> dict[Digest, re_pb2.Directory]:
    """Every Directory message reachable from `root`, by digest."""
    directories: dict[Digest, re_pb2.Directory] = {}
    level = [root]
    while level:
        blobs = source.download(level)
        following: list[Digest] = []
        for digest in level:
            directory = re_pb2.Directory.FromString(blobs[digest])
            directories[digest] = directory
            for child in directory.directories:
                child_digest = _digest(child.digest)
                if child_digest not in directories and child_digest not in following:
                    following.append(child_digest)
        level = [d for d in following if d not in directories]
    return directories


def materialise(source: BlobSource, root: Digest, into: Path) -> int:
    """Write the input tree under `into` (which must exist); returns the number of files."""
    directories = fetch_tree(source, root)
    files: list[tuple[Path, Digest, bool]] = []
    links: list[tuple[Path, str]] = []

    def walk(digest: Digest, at: Path) -> None:
        directory = directories[digest]
        for node in directory.files:
            files.append((at / _name(node.name), _digest(node.digest), node.is_executable))
        for link in directory.symlinks:
            links.append((at / _name(link.name), link.target))
        for child in directory.directories:
            path = at / _name(child.name)
            path.mkdir()
            walk(_digest(child.digest), path)

    walk(root, into)
    contents = source.download(list(dict.fromkeys(d for _, d, _ in files)))
    for path, digest, executable in files:
        with open(path, "wb") as f:
            f.write(contents[digest])
        if executable:
            os.chmod(path, 0o755)
    for path, target in links:
        os.symlink(target, path)
    return len(files)
