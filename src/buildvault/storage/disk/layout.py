"""Where each entry lives on disk and how it is keyed in memory.

Layout under the store's root:

    cas/<fn>/<hh>/<hash>-<size>                  CAS blobs (fn: sha256 | blake3, hh: first two hex digits)
    ac/<kind>/<instance...>/@<fn>/<hh>/<hash>    action entries; '@' never appears in a namespace
                                                 segment, so no namespace can shadow another's files
    records/data.mdb, lock.mdb                   small blobs and action entries: an LMDB environment (records.py)
    tmp/<random>.tmp                             writes in progress (same filesystem: one atomic rename)
    index.lru                                    the index snapshot (snapshot.py)
    SYNC                                         the last sync point (durability.py)
    LOCK                                         flock'ed by the one process using the root

Index keys (bytes, so one dict entry is small): a CAS key is the digest-function byte, the raw
32-byte hash and a 6-byte size (39 bytes); an AC key is b"A", the namespace, a NUL, the function
byte and the raw hash. A directory id names a leaf directory the same way (see `dir_id`).
This module owns that format (its constants) and the parsing of leaf directory listings back
into keys; core.py makes the keys and paths of live operations (`cas_key`, `Layout`, `AcKeys`),
where every request needs them.
"""

from __future__ import annotations

import contextlib
import os
import re
import time

from buildvault.digest import DigestFunction, InvalidDigest

FN_BYTE = {fn: bytes([fn.wire]) for fn in DigestFunction}
FN_BY_BYTE = {fn.wire: fn for fn in DigestFunction}
SIZE_BYTES = 6  # 256 TiB: more than any disk cache; keeps a key at 39 bytes (a 72-byte object)
MAX_BLOB = 1 << (8 * SIZE_BYTES)
AC_TAG = ord("A")  # first byte of AC keys; CAS keys start with a digest-function wire number (1 or 9)
MAX_KEY = 511  # LMDB's key limit; a longer AC key (a very long instance name) stays a file
SHARDS = tuple(f"{i:02x}" for i in range(256))
SHARD_SET = frozenset(SHARDS)
SEGMENT = re.compile(r"[A-Za-z0-9_.\-]+")
# A directory modified this recently when its mtime is read may change again within the same
# filesystem clock tick without its mtime changing: such a directory is not trusted (snapshot.py).
RACY_NS = 1_000_000_000

# dir id -> (path, mtime in ns, or -1 when modified too recently to be trusted)
LeafDirs = dict[bytes, tuple[str, int]]


def is_ac(key: bytes) -> bool:
    return key[0] == AC_TAG


def kind_of(key: bytes) -> str:
    """The kind of an AC key's namespace ("ac", "raw", ...): its first segment."""
    namespace = key[1 : key.index(b"\x00")].decode()
    return namespace.split("/", 1)[0]


def check_namespace(namespace: str) -> None:
    """Raise InvalidDigest unless every segment is a plain name (no path can escape the root)."""
    for segment in namespace.split("/"):
        if segment in (".", "..") or not SEGMENT.fullmatch(segment):
            raise InvalidDigest(f"invalid action namespace {namespace[:100]!r}")


def dir_id(key: bytes) -> bytes:
    """The leaf directory of an entry: function byte + first hash byte (CAS), or AC prefix + first hash byte."""
    return key[:2] if key[0] != AC_TAG else key[:-31]


def key_of_name(leaf: bytes, name: str) -> bytes | None:
    """The key of file `name` in the leaf directory `leaf` (a dir id), or None if it is no entry's name."""
    if leaf[0] == AC_TAG:
        try:
            raw = bytes.fromhex(name)
        except ValueError:
            return None
        return leaf[:-1] + raw if len(raw) == 32 else None
    hex_hash, _, size_text = name.partition("-")
    try:
        raw = bytes.fromhex(hex_hash)
        size = int(size_text)
    except ValueError:
        return None
    if len(raw) != 32 or not 0 <= size < MAX_BLOB:
        return None
    return leaf[:1] + raw + size.to_bytes(SIZE_BYTES, "big")


def scan_cas_dir(path: str, fn_byte: bytes, shard: str) -> tuple[list[tuple[bytes, int, str]], int]:
    """Parse `<hash>-<size>` names: (key, size, name) for each entry, and the count of stray files."""
    found = []
    strays = 0
    for name in os.listdir(path):
        hex_hash, _, size_text = name.partition("-")
        try:
            raw = bytes.fromhex(hex_hash)
            size = int(size_text)
        except ValueError:
            strays += 1
            continue
        canonical = raw.hex() == hex_hash and str(size) == size_text
        if len(raw) != 32 or not canonical or not hex_hash.startswith(shard) or size >= MAX_BLOB:
            strays += 1
            continue
        found.append((fn_byte + raw + size.to_bytes(SIZE_BYTES, "big"), size, name))
    return found, strays


def scan_ac_dir(path: str, prefix: bytes) -> tuple[list[tuple[bytes, int, str]], int]:
    """Parse `<hash>` names of one AC leaf directory (sizes need a stat: entries are replaced in place)."""
    shard = os.path.basename(path)
    found = []
    strays = 0
    for name in os.listdir(path):
        try:
            raw = bytes.fromhex(name)
        except ValueError:
            raw = b""
        if len(raw) != 32 or raw.hex() != name or not name.startswith(shard):
            strays += 1
            continue
        found.append((prefix + raw, os.stat(path + "/" + name).st_size, name))
    return found, strays


def sizes_named(directory: str, hex_hash: str) -> list[int]:
    """Sizes in the `<hash>-<size>` names of one CAS shard directory for this hash."""
    prefix = hex_hash + "-"
    sizes = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith(prefix):
            with contextlib.suppress(ValueError):
                sizes.append(int(name[len(prefix) :]))
    return sizes


def leaf_dirs(cas_dir: str, ac_dir: str, racy_ns: int) -> LeafDirs:
    """Every leaf directory as dir id -> (path, mtime_ns); -1 when modified within `racy_ns` of now.

    Creates missing CAS shard directories. Lists only the upper AC levels, never leaf contents.
    Runs in a worker thread.
    """
    now = time.time_ns()
    dirs: LeafDirs = {}

    def add(dir_id: bytes, path: str) -> None:
        mtime = os.stat(path).st_mtime_ns
        dirs[dir_id] = (path, -1 if mtime > now - racy_ns else mtime)

    for fn in DigestFunction:
        base = os.path.join(cas_dir, fn.label)
        for shard in SHARDS:
            path = base + "/" + shard
            try:
                add(FN_BYTE[fn] + bytes.fromhex(shard), path)
            except FileNotFoundError:
                os.makedirs(path, exist_ok=True)
                add(FN_BYTE[fn] + bytes.fromhex(shard), path)

    def walk(path: str, segments: list[str]) -> None:
        with os.scandir(path) as entries:
            children = [entry for entry in entries if entry.is_dir(follow_symlinks=False)]
        for child in children:
            if child.name.startswith("@") and segments:
                try:
                    fn_byte = FN_BYTE[DigestFunction.from_label(child.name[1:])]
                except InvalidDigest:
                    continue
                prefix = b"A" + "/".join(segments).encode() + b"\x00" + fn_byte
                with os.scandir(child.path) as shards:
                    for shard in shards:
                        if shard.name in SHARD_SET and shard.is_dir(follow_symlinks=False):
                            add(prefix + bytes.fromhex(shard.name), shard.path)
            elif SEGMENT.fullmatch(child.name) and child.name not in (".", ".."):
                walk(child.path, [*segments, child.name])

    walk(ac_dir, [])
    return dirs


def ac_namespaces(ac_dir: str) -> list[str]:
    """Every AC namespace with a directory on disk ("ac", "ac/team", "raw", ...), sorted.

    Lists directories only, never leaf contents; runs in a worker thread."""
    found: list[str] = []

    def walk(path: str, segments: list[str]) -> None:
        try:
            with os.scandir(path) as entries:
                children = [entry for entry in entries if entry.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return
        if segments and any(child.name.startswith("@") for child in children):
            found.append("/".join(segments))
        for child in children:
            if not child.name.startswith("@") and SEGMENT.fullmatch(child.name) and child.name not in (".", ".."):
                walk(child.path, [*segments, child.name])

    walk(ac_dir, [])
    return sorted(found)
