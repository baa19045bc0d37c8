"""`buildvault artifact push|pull|pin|unpin|pins`: whole-build outputs under an exact key.

The key is an REAPI Action: Command `buildvault-artifact/1 NAME`, the key tree (`--key-tree`:
its files as `git ls-files` lists them in a git checkout, else every file but the default
excludes) as the input root, `--key-value`s, `--platform` properties and OS/arch as platform.
The ActionResult holds one OutputDirectory, `artifact`, whose Tree is every pushed path
(relative to `--base`). Pins live in the pin index (buildvault/pins.py).
"""

from __future__ import annotations

import argparse
import os
import platform as platform_mod
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from buildvault import pins
from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.remote_apis import re_pb2

from ..keys import FileHasher, action_blobs, serialize
from ..pin_index import read_index, write_index
from ..remote import Remote, RemoteError
from ..roots import Roots
from .key import InputWalker
from .outputs import UnusableResult, add_tree, restore
from .spec import DEFAULT_EXCLUDES, SpecError, parse_platform
from .tree import TreeBuilder

KEY_VERSION = "buildvault-artifact/1"
ARTIFACT_DIR = "artifact"
HIT, ERROR, USAGE, MISS = 0, 1, 2, 3


@dataclass
class ArtifactKey:
    digest: Digest
    blobs: dict[Digest, bytes]


def key_tree_files(directory: str) -> list[str] | None:
    """Paths (relative to `directory`) `git ls-files` gives for it, or None outside a git checkout."""
    try:
        done = subprocess.run(["git", "-C", directory, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                              capture_output=True, check=False, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    names = sorted({n for n in done.stdout.decode("utf-8", "surrogateescape").split("\0") if n})
    return [n for n in names if os.path.lexists(os.path.join(directory, n))]  # deleted but still in the index


def artifact_key(name: str, key_trees: list[str], key_values: list[tuple[str, str]],
                 platform: list[tuple[str, str]]) -> ArtifactKey:
    roots = Roots([(f"K{i}", tree) for i, tree in enumerate(key_trees)])
    walker = InputWalker(roots, FileHasher(), list(DEFAULT_EXCLUDES))
    for tree in key_trees:
        if not os.path.isdir(tree):
            raise SpecError(f"--key-tree {tree}: not a directory")
        listed = key_tree_files(tree)
        if listed is None:
            walker.add(tree)
        else:
            walker.tree.add_dir(roots.layout(os.path.abspath(tree)))
            for rel in listed:
                walker.add(os.path.join(tree, rel))
    root, blobs = walker.tree.root()
    props = {"OSFamily": platform_mod.system().lower(), "arch": platform_mod.machine().lower(), "key": KEY_VERSION}
    props.update({f"value.{k}": v for k, v in key_values})
    props.update(platform)
    plat = re_pb2.Platform(properties=[re_pb2.Platform.Property(name=k, value=v) for k, v in sorted(props.items())])
    command = re_pb2.Command(arguments=[KEY_VERSION, name], output_directories=[ARTIFACT_DIR], platform=plat)
    digest, action_and_command = action_blobs(command, root, plat)
    blobs.update(action_and_command)
    return ArtifactKey(digest, blobs)


def _say(text: str) -> None:
    print(f"buildvault artifact: {text}", file=sys.stderr, flush=True)


def _remote(args: argparse.Namespace, env: Mapping[str, str]) -> Remote:
    url = args.remote or env.get("BUILDVAULT_REMOTE", "")
    if not url:
        raise SpecError("no cache: set BUILDVAULT_REMOTE or --remote")
    timeout = float(env.get("BUILDVAULT_TIMEOUT", "") or 10)
    return Remote(url, args.instance if args.instance is not None else env.get("BUILDVAULT_INSTANCE", ""),
                  timeout=timeout, upload_timeout=max(timeout * 6, 60.0))


def _writer(args: argparse.Namespace, env: Mapping[str, str]) -> bool:
    return bool(args.writer) or env.get("BUILDVAULT_WRITER", "") in ("1", "true", "yes")


def _pairs(items: list[str], what: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SpecError(f"{what} {item!r}: want NAME=VALUE")
        out.append((k, v))
    return out


def _key_from_args(args: argparse.Namespace) -> ArtifactKey:
    platform = [p for text in args.platform for p in parse_platform(text)]
    return artifact_key(args.name, [os.path.abspath(t) for t in args.key_tree],
                        _pairs(args.key_value, "--key-value"), platform)


def _parse_key(text: str) -> Digest:
    hash_, _, size = text.partition("/")
    try:
        return Digest.parse(hash_, int(size), DigestFunction.SHA256)
    except (InvalidDigest, ValueError):
        raise SpecError(f"key {text!r}: want HASH/SIZE as push prints it") from None


def _artifact_tree(result: re_pb2.ActionResult) -> re_pb2.Digest:
    dirs = [d for d in result.output_directories if d.path == ARTIFACT_DIR]
    if len(dirs) != 1 or result.output_files or result.output_symlinks:
        raise UnusableResult("not an artifact entry")
    return dirs[0].tree_digest


def set_pin(remote: Remote, name: str, label: str, key: Digest, tree: re_pb2.Digest) -> None:
    """Add (or move) pin NAME/LABEL to the artifact `key` whose Tree is `tree` (read-modify-write)."""
    index = read_index(remote)
    path = f"{name}/{label}"
    kept = re_pb2.ActionResult()
    kept.output_directories.extend(d for d in index.output_directories if d.path != path)
    kept.output_files.extend(f for f in index.output_files if f.path != f"{path}.key")
    kept.output_directories.add(path=path, tree_digest=tree)
    key_blob = f"{key.hash}/{key.size_bytes}".encode()
    kd = Digest.of(key_blob)
    remote.upload({kd: key_blob} if remote.find_missing([kd]) else {})
    kept.output_files.add(path=f"{path}.key", digest=kd.to_proto(re_pb2.Digest))
    write_index(remote, kept)


def remove_pin(remote: Remote, name: str, label: str) -> bool:
    index = read_index(remote)
    path = f"{name}/{label}"
    if path not in pins.pinned_trees(index):
        return False
    kept = re_pb2.ActionResult()
    kept.output_directories.extend(d for d in index.output_directories if d.path != path)
    kept.output_files.extend(f for f in index.output_files if f.path != f"{path}.key")
    write_index(remote, kept)
    return True


def push(args: argparse.Namespace, env: Mapping[str, str], remote: Remote) -> int:
    if not _writer(args, env):
        _say("push needs write permission (BUILDVAULT_WRITER=1 or --writer)")
        return USAGE
    key = _key_from_args(args)
    base = os.path.abspath(args.base)
    builder = TreeBuilder()
    blobs: dict[Digest, bytes] = {}
    count = 0
    for path in args.paths:
        full = os.path.normpath(os.path.join(base, path))
        rel = os.path.relpath(full, base)
        if rel == "." or rel.startswith("../"):
            raise SpecError(f"{path} is not inside --base {base}")
        if os.path.isdir(full) and not os.path.islink(full):
            count += add_tree(builder, full, Roots([]), blobs, prefix=rel)
        elif os.path.islink(full):
            builder.add_symlink(rel, os.readlink(full))
            count += 1
        elif os.path.isfile(full):
            with open(full, "rb") as f:
                data = f.read()
            d = Digest.of(data)
            blobs[d] = data
            builder.add_file(rel, d, bool(os.stat(full).st_mode & 0o111))
            count += 1
        else:
            raise SpecError(f"{path}: not found")
    if count == 0:
        raise SpecError("nothing to push")
    tree_data = serialize(builder.tree())
    tree_digest = Digest.of(tree_data)
    blobs[tree_digest] = tree_data
    blobs.update(key.blobs)
    remote.upload({d: blobs[d] for d in remote.find_missing(blobs)})
    result = re_pb2.ActionResult()
    result.output_directories.add(path=ARTIFACT_DIR, tree_digest=tree_digest.to_proto(re_pb2.Digest))
    remote.update_action_result(key.digest, result)
    shown = f"{key.digest.hash}/{key.digest.size_bytes}"
    if args.pin:
        set_pin(remote, args.name, args.pin, key.digest, tree_digest.to_proto(re_pb2.Digest))
    pinned = f" pin={args.pin}" if args.pin else ""
    print(f"[buildvault] PUSHED artifact={args.name} key={shown} files={count}{pinned}")
    return HIT


def pull(args: argparse.Namespace, env: Mapping[str, str], remote: Remote) -> int:
    dest = os.path.abspath(args.dest)
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise SpecError(f"--dest {args.dest}: must be absent or an empty directory")
    if args.pinned:
        tree = pins.pinned_trees(read_index(remote)).get(f"{args.name}/{args.pinned}")
        shown = f"pin={args.pinned}"
    else:
        key = _key_from_args(args)
        shown = f"key={key.digest.hash}/{key.digest.size_bytes}"
        found = remote.get_action_result(key.digest)
        try:
            tree = _artifact_tree(found) if found is not None else None
        except UnusableResult:
            tree = None
    if tree is None:
        print(f"[buildvault] MISS artifact={args.name} {shown}")
        return MISS
    result = re_pb2.ActionResult()
    result.output_directories.add(path=os.path.basename(dest), tree_digest=tree)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        count = restore(result, os.path.dirname(dest), [os.path.basename(dest)], None, Roots([]), remote.download)
    except (UnusableResult, RemoteError) as e:
        _say(f"cached artifact unusable ({e})")
        print(f"[buildvault] MISS artifact={args.name} {shown}")
        return MISS
    print(f"[buildvault] HIT artifact={args.name} {shown} files={count}")
    return HIT


def pin(args: argparse.Namespace, env: Mapping[str, str], remote: Remote) -> int:
    if not _writer(args, env):
        _say("pin needs write permission (BUILDVAULT_WRITER=1 or --writer)")
        return USAGE
    key = _parse_key(args.key)
    found = remote.get_action_result(key)
    if found is None:
        _say(f"no artifact with key {args.key}")
        return MISS
    set_pin(remote, args.name, args.label, key, _artifact_tree(found))
    print(f"[buildvault] PINNED artifact={args.name} key={args.key} pin={args.label}")
    return HIT


def unpin(args: argparse.Namespace, env: Mapping[str, str], remote: Remote) -> int:
    if not _writer(args, env):
        _say("unpin needs write permission (BUILDVAULT_WRITER=1 or --writer)")
        return USAGE
    if not remove_pin(remote, args.name, args.label):
        _say(f"no pin {args.name}/{args.label}")
        return MISS
    print(f"[buildvault] UNPINNED artifact={args.name} pin={args.label}")
    return HIT


def list_pins(args: argparse.Namespace, env: Mapping[str, str], remote: Remote) -> int:
    index = read_index(remote)
    keys = {f.path[: -len(".key")]: f.digest for f in index.output_files if f.path.endswith(".key")}
    key_text = remote.download([Digest.from_proto(d) for d in keys.values()]) if keys else {}
    for path in sorted(pins.pinned_trees(index)):
        name, _, label = path.partition("/")
        d = keys.get(path)
        key = key_text[Digest.from_proto(d)].decode() if d is not None else "?"
        print(f"{name}\t{label}\t{key}")
    return HIT


ACTIONS = {"push": push, "pull": pull, "pin": pin, "unpin": unpin, "pins": list_pins}


def main_artifact(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    for what in ("name", "label", "pin", "pinned"):
        value = getattr(args, what, None)
        if value is not None and not pins.valid_name(value):
            _say(f"{what} {value!r}: use letters, digits and _ . + - (not starting with . or -)")
            return USAGE
    try:
        remote = _remote(args, env)
    except (SpecError, RemoteError) as e:
        _say(str(e))
        return USAGE
    try:
        return ACTIONS[args.artifact_command](args, env, remote)
    except SpecError as e:
        _say(str(e))
        return USAGE
    except (RemoteError, UnusableResult, OSError) as e:
        _say(str(e))
        return ERROR
    finally:
        remote.close()
