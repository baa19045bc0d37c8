"""A step's outputs: read into an ActionResult after a run, restored from one on a hit.

Restoring trusts nothing in the ActionResult: every path must be a clean relative path that
the step declared (or, with --output-dir, one under that directory), every blob is verified
against its digest, and nothing is written until all of it has been fetched and checked.
Files (and whole output directories) are written to temporary names and renamed into place,
then symlinks, so a failed restore leaves no half-written output.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from buildvault.digest import Digest, InvalidDigest
from buildvault.remote_apis import re_pb2

from ..keys import serialize
from ..roots import Roots
from .tree import TreeBuilder

Fetch = Callable[[Iterable[Digest]], dict[Digest, bytes]]


class OutputError(Exception):
    """The step's outputs cannot be stored (a declared output is missing, none were made)."""


class UnusableResult(Exception):
    """A cached ActionResult that must not be restored (bad path, undeclared output, bad blob)."""


@dataclass
class Collected:
    result: re_pb2.ActionResult
    blobs: dict[Digest, bytes] = field(default_factory=dict)
    count: int = 0


# -- after a run -------------------------------------------------------------------------------
Signature = tuple[int, int, int, int]


def snapshot(directory: str) -> dict[str, Signature]:
    """{path relative to `directory`: (type, size, mtime_ns, inode)} of every file and symlink in it."""
    out: dict[str, Signature] = {}
    if not os.path.isdir(directory):
        return out
    for here, dirs, files in os.walk(directory):
        dirs.sort()
        for name in [*files, *(d for d in dirs if os.path.islink(os.path.join(here, d)))]:
            full = os.path.join(here, name)
            st = os.lstat(full)
            out[os.path.relpath(full, directory)] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def discovered(directory: str, before: dict[str, Signature]) -> list[str]:
    """Files and symlinks in `directory` that are new or changed since `before`."""
    after = snapshot(directory)
    return sorted(rel for rel, sig in after.items() if before.get(rel) != sig)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def add_tree(builder: TreeBuilder, top: str, roots: Roots, blobs: dict[Digest, bytes], prefix: str = "") -> int:
    """Add everything under directory `top` to `builder` (at `prefix/`), file contents to `blobs`."""
    count = 0
    if prefix:
        builder.add_dir(prefix)
    for here, dirs, files in os.walk(top):
        dirs.sort()
        for name in sorted([*files, *(d for d in dirs if os.path.islink(os.path.join(here, d)))]):
            full = os.path.join(here, name)
            rel = os.path.join(prefix, os.path.relpath(full, top))
            if os.path.islink(full):
                builder.add_symlink(rel, roots.normalize(os.readlink(full)))
            else:
                data = _read(full)
                digest = Digest.of(data)
                blobs[digest] = data
                builder.add_file(rel, digest, bool(os.stat(full).st_mode & 0o111))
            count += 1
        for name in dirs:
            if not os.path.islink(os.path.join(here, name)):
                builder.add_dir(os.path.join(prefix, os.path.relpath(os.path.join(here, name), top)))
    return count


def collect(workdir: str, paths: list[str], roots: Roots) -> Collected:
    """The outputs at `paths` (relative to `workdir`): files, symlinks and whole directories."""
    if not paths:
        raise OutputError("the step produced no outputs")
    out = Collected(re_pb2.ActionResult())
    for rel in paths:
        full = os.path.join(workdir, rel)
        if os.path.islink(full):
            out.result.output_symlinks.add(path=rel, target=roots.normalize(os.readlink(full)))
            out.count += 1
        elif os.path.isdir(full):
            builder = TreeBuilder()
            out.count += add_tree(builder, full, roots, out.blobs)
            data = serialize(builder.tree())
            digest = Digest.of(data)
            out.blobs[digest] = data
            out.result.output_directories.add(path=rel, tree_digest=digest.to_proto(re_pb2.Digest))
        elif os.path.isfile(full):
            data = _read(full)
            digest = Digest.of(data)
            out.blobs[digest] = data
            executable = bool(os.stat(full).st_mode & 0o111)
            out.result.output_files.add(path=rel, digest=digest.to_proto(re_pb2.Digest), is_executable=executable)
            out.count += 1
        else:
            raise OutputError(f"declared output was not created: {rel}")
    return out


# -- on a hit ----------------------------------------------------------------------------------
def clean_relative(path: str) -> bool:
    """A non-empty relative '/'-path with no '', '.' or '..' component (cannot leave its base)."""
    if not path or path.startswith("/") or "\0" in path:
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


def _digest(message: re_pb2.Digest, what: str) -> Digest:
    try:
        return Digest.from_proto(message)
    except InvalidDigest as e:
        raise UnusableResult(f"{what}: {e}") from None


def _allowed(path: str, declared: list[str], discover_under: str | None) -> bool:
    if discover_under is not None:
        return discover_under in ("", ".") or path == discover_under or path.startswith(discover_under + "/")
    return path in declared


@dataclass
class _Plan:
    files: list[tuple[str, Digest, bool]] = field(default_factory=list)  # (path under workdir, digest, exec)
    dirs: list[tuple[str, re_pb2.Tree]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)


def _tree_entries(tree: re_pb2.Tree, base: str, plan_files: list[tuple[str, Digest, bool]],
                  links: list[tuple[str, str]]) -> None:
    children = {Digest.of(serialize(d)): d for d in tree.children}

    def walk(d: re_pb2.Directory, prefix: str, depth: int) -> None:
        if depth > 256:
            raise UnusableResult("output tree too deep")
        for f in d.files:
            if not clean_relative(f.name) or "/" in f.name:
                raise UnusableResult(f"bad file name {f.name!r} in output tree {base}")
            plan_files.append((f"{prefix}/{f.name}", _digest(f.digest, f.name), f.is_executable))
        for s in d.symlinks:
            if not clean_relative(s.name) or "/" in s.name:
                raise UnusableResult(f"bad symlink name {s.name!r} in output tree {base}")
            links.append((f"{prefix}/{s.name}", s.target))
        for sub in d.directories:
            if not clean_relative(sub.name) or "/" in sub.name:
                raise UnusableResult(f"bad directory name {sub.name!r} in output tree {base}")
            child = children.get(_digest(sub.digest, sub.name))
            if child is None:
                raise UnusableResult(f"output tree {base} lacks directory {sub.name}")
            walk(child, f"{prefix}/{sub.name}", depth + 1)

    walk(tree.root, base, 0)


def _inside(workdir_real: str, path: str) -> bool:
    parent = os.path.realpath(os.path.dirname(path))
    return parent == workdir_real or parent.startswith(workdir_real + "/")


def _write_file(path: str, data: bytes, executable: bool) -> str:
    """Write `data` beside `path` under a temporary name; returns that name."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.bv{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o755 if executable else 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return tmp


def _replace_dir(tmp: str, path: str) -> None:
    old = None
    if os.path.lexists(path):
        old = f"{path}.bvold{os.getpid()}"
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.unlink(old)


def _place_link(path: str, target: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.bv{os.getpid()}.lnk")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, path)


def restore(result: re_pb2.ActionResult, workdir: str, declared: list[str], discover_under: str | None,
            roots: Roots, fetch: Fetch) -> int:
    """Write the outputs of `result` under `workdir`; the number of files and links restored.

    Raises UnusableResult (nothing written) for a path that is not clean and declared, a blob that
    does not match its digest or a Tree that is not one; `fetch` errors propagate as raised."""
    plan = _Plan()
    seen: set[str] = set()
    named = [f.path for f in result.output_files] + [s.path for s in result.output_symlinks] + \
        [d.path for d in result.output_directories] + [s.path for s in result.output_file_symlinks] + \
        [s.path for s in result.output_directory_symlinks]
    for path in named:
        if not clean_relative(path) or not _allowed(path, declared, discover_under) or path in seen:
            raise UnusableResult(f"cached result names output {path[:200]!r}, which this step does not declare")
        seen.add(path)
    if discover_under is None and seen != set(declared):
        raise UnusableResult(f"cached result has outputs {sorted(seen)}, the step declares {sorted(declared)}")
    if not seen:
        raise UnusableResult("cached result has no outputs")
    for f in result.output_files:
        plan.files.append((f.path, _digest(f.digest, f.path), f.is_executable))
    for s in [*result.output_symlinks, *result.output_file_symlinks, *result.output_directory_symlinks]:
        plan.links.append((s.path, s.target))
    tree_digests = {d.path: _digest(d.tree_digest, d.path) for d in result.output_directories}
    inline = {f.path: f.contents for f in result.output_files if f.contents}
    blobs = fetch(list(tree_digests.values())) if tree_digests else {}
    dir_files: dict[str, list[tuple[str, Digest, bool]]] = {}
    dir_links: dict[str, list[tuple[str, str]]] = {}
    for path, digest in tree_digests.items():
        tree = re_pb2.Tree()
        data = blobs.get(digest)
        if data is None or Digest.of(data) != digest:
            raise UnusableResult(f"output tree {path}: blob failed verification")
        try:
            tree.ParseFromString(data)
        except Exception as e:  # DecodeError: the blob is not a Tree
            raise UnusableResult(f"output tree {path}: {e}") from None
        dir_files[path], dir_links[path] = [], []
        _tree_entries(tree, path, dir_files[path], dir_links[path])
    wanted = [d for _p, d, _x in plan.files] + [d for fs in dir_files.values() for _p, d, _x in fs]
    missing = [d for d in dict.fromkeys(wanted) if d.size_bytes > 0]
    contents: dict[Digest, bytes] = {Digest.of(b""): b""}
    for data in inline.values():
        contents[Digest.of(data)] = data
    fetched = fetch([d for d in missing if d not in contents]) if missing else {}
    contents.update(fetched)
    for d in dict.fromkeys(wanted):
        data = contents.get(d)
        if data is None or Digest.of(data) != d:
            raise UnusableResult(f"output blob {d} failed verification")
    real = os.path.realpath(workdir)
    every = [p for p, _, _ in plan.files] + [p for p, _ in plan.links] + list(dir_files)
    for p in every:
        if not _inside(real, os.path.join(workdir, p)):
            raise UnusableResult(f"output {p} would be written outside {workdir}")
    count = 0
    placed: list[tuple[str, str]] = []
    try:
        for p, d, x in plan.files:
            full = os.path.join(workdir, p)
            placed.append((_write_file(full, contents[d], x), full))
        for p in dir_files:
            full = os.path.join(workdir, p)
            tmp = f"{full}.bvtmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            for sub, d, x in dir_files[p]:
                os.replace(_write_file(os.path.join(tmp, sub[len(p) + 1:]), contents[d], x),
                           os.path.join(tmp, sub[len(p) + 1:]))
            for sub, target in dir_links[p]:
                _place_link(os.path.join(tmp, sub[len(p) + 1:]), roots.denormalize(target))
            placed.append((tmp, full))
            count += len(dir_files[p]) + len(dir_links[p])
    except BaseException:
        for tmp, _ in placed:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            elif os.path.lexists(tmp):
                os.unlink(tmp)
        raise
    for tmp, full in placed:
        if os.path.isdir(tmp):
            _replace_dir(tmp, full)
        else:
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            os.replace(tmp, full)
    count += len(plan.files)
    for p, target in plan.links:
        _place_link(os.path.join(workdir, p), roots.denormalize(target))
        count += 1
    return count
