"""Collect an action's outputs into an ActionResult and the blobs it references.

Both ways of naming outputs are served: `output_paths` (REAPI v2.1+) and the older
`output_files` / `output_directories` (all Bazel 4.2.3 sends). Directories become `Tree` blobs
whose children are the canonical Directory messages their DirectoryNodes name; symlinks are
reported in the new `output_symlinks` and in the deprecated `output_file_symlinks` /
`output_directory_symlinks` fields (the only ones Bazel 4.2.3 reads). A declared output that does
not exist is simply absent, as the spec says.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2


@dataclass
class Collected:
    """The outputs' part of an ActionResult, and every blob it references (by digest)."""

    result: re_pb2.ActionResult = field(default_factory=re_pb2.ActionResult)
    blobs: dict[Digest, bytes] = field(default_factory=dict)

    def add_blob(self, data: bytes) -> re_pb2.Digest:
        digest = Digest.of(data)
        self.blobs.setdefault(digest, data)
        return digest.to_proto(re_pb2.Digest)


def _executable(mode: int) -> bool:
    return bool(mode & stat.S_IXUSR)


def _directory(path: Path, into: Collected, children: dict[str, re_pb2.Directory]) -> re_pb2.Directory:
    """The canonical Directory of `path` (entries sorted by name); sub-directories go to `children`."""
    directory = re_pb2.Directory()
    with os.scandir(path) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                directory.symlinks.add(name=entry.name, target=os.readlink(entry.path))
            elif stat.S_ISDIR(info.st_mode):
                child = _directory(Path(entry.path), into, children)
                data = child.SerializeToString(deterministic=True)
                children.setdefault(Digest.of(data).hash, child)
                directory.directories.add(name=entry.name, digest=into.add_blob(data))
            elif stat.S_ISREG(info.st_mode):
                digest = into.add_blob(Path(entry.path).read_bytes())
                directory.files.add(name=entry.name, digest=digest, is_executable=_executable(info.st_mode))
    return directory


def _tree(path: Path, into: Collected) -> re_pb2.Digest:
    children: dict[str, re_pb2.Directory] = {}
    root = _directory(path, into, children)
    tree = re_pb2.Tree(root=root, children=[children[k] for k in sorted(children)])
    return into.add_blob(tree.SerializeToString(deterministic=True))


def _add(path: str, workdir: Path, into: Collected, want: str) -> None:
    """One declared output; `want` is 'file', 'directory' or 'any' (output_paths)."""
    full = workdir / path
    try:
        info = os.lstat(full)
    except FileNotFoundError:
        return
    result = into.result
    if stat.S_ISLNK(info.st_mode):
        link = re_pb2.OutputSymlink(path=path, target=os.readlink(full))
        result.output_symlinks.append(link)
        points_to_dir = full.is_dir()
        if want == "directory" or (want == "any" and points_to_dir):
            result.output_directory_symlinks.append(link)
        else:
            result.output_file_symlinks.append(link)
    elif stat.S_ISDIR(info.st_mode):
        if want != "file":
            result.output_directories.add(path=path, tree_digest=_tree(full, into), is_topologically_sorted=False)
    elif stat.S_ISREG(info.st_mode) and want != "directory":
        digest = into.add_blob(full.read_bytes())
        result.output_files.add(path=path, digest=digest, is_executable=_executable(info.st_mode))


def output_dirs_to_create(command: re_pb2.Command) -> list[str]:
    """Directories to create before the run, relative to the working directory: the parents of
    every output (the spec: not the output directories themselves)."""
    wanted: dict[str, None] = {}
    for path in [*command.output_paths, *command.output_files, *command.output_directories]:
        parent = os.path.dirname(path)
        if parent:
            wanted.setdefault(parent)
    return list(wanted)


def collect(command: re_pb2.Command, workdir: Path) -> Collected:
    """The outputs `command` declares, as found under `workdir` after the run."""
    into = Collected()
    if command.output_paths:
        for path in command.output_paths:
            _add(path, workdir, into, "any")
    else:
        for path in command.output_files:
            _add(path, workdir, into, "file")
        for path in command.output_directories:
            _add(path, workdir, into, "directory")
    return into


def check_output_path(path: str) -> None:
    """Raise ValueError for an output path that could escape the working directory."""
    if not path or path.startswith("/") or "\0" in path or any(p in ("..",) for p in path.split("/")):
        raise ValueError(f"unsafe output path {path!r}")
