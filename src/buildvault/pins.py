"""Golden versions: the pin index that clients write and the server protects.

The index is an ordinary ActionCache entry, so any REAPI cache can hold it: its key is the
digest of a fixed Action (`INDEX_DIGEST`, Command `buildvault-pins/1`), one per instance.
Each pin is an OutputDirectory `NAME/LABEL` whose Tree is the pinned artifact's whole tree,
plus an OutputFile `NAME/LABEL.key` holding the artifact's key (`hash/size`). A server that
knows this format keeps every blob an index names (the Tree blobs and every file in them).

A pinned Remote Asset (`buildvault asset pin`) is two OutputFiles: `assets/LABEL.blob`, the
asset's content, and `assets/LABEL.entries`, a blob naming the asset index entries to keep (one
line `FUNCTION HASH/SIZE` each: the entry's key digest in the instance's `asset` namespace).
Neither path ends in `.key`, so a reader that knows only artifact pins keeps both blobs and
nothing more. A pinned directory asset (recorded by PushDirectory) has the same two files, its
`.blob` being the root Directory, and an OutputDirectory `assets/LABEL/tree` whose Tree is the
directory's whole tree (root_directory_digest: the root): the pinned Tree of an artifact pin,
so a server keeps it and every blob it names as it keeps an artifact's. Its path has two
slashes, so it is never taken for an artifact pin `NAME/LABEL`.
"""

from __future__ import annotations

import re

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

INDEX_COMMAND = "buildvault-pins/1"
ASSET_DIR = "assets"
_ASSET_BLOB, _ASSET_ENTRIES, _ASSET_TREE = ".blob", ".entries", "/tree"
_FUNCTIONS = ("sha256", "blake3")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")


def _index_action() -> tuple[bytes, bytes]:
    command = re_pb2.Command(arguments=[INDEX_COMMAND]).SerializeToString(deterministic=True)
    cd = Digest.of(command)
    action = re_pb2.Action(command_digest=cd.to_proto(re_pb2.Digest), do_not_cache=False)
    return action.SerializeToString(deterministic=True), command


INDEX_ACTION, INDEX_COMMAND_BLOB = _index_action()
INDEX_DIGEST = Digest.of(INDEX_ACTION)


def valid_name(text: str) -> bool:
    """Artifact names and pin labels: letters, digits, `_ . + -`, not starting with `.` or `-`."""
    return bool(_NAME.match(text))


def pinned_trees(index: re_pb2.ActionResult) -> dict[str, re_pb2.Digest]:
    """{"NAME/LABEL": Tree digest} of the artifact pins of a pin index (not directory assets')."""
    return {d.path: d.tree_digest for d in index.output_directories if d.path.count("/") == 1}


def key_blobs(index: re_pb2.ActionResult) -> list[re_pb2.Digest]:
    """Digests of the `NAME/LABEL.key` blobs of a pin index (each holds a pinned artifact's key)."""
    return [f.digest for f in index.output_files if f.path.endswith(".key")]


def parse_artifact_key(data: bytes) -> tuple[str, int] | None:
    """(hash, size) of an artifact's action key from a `.key` blob (`hash/size`); None if malformed."""
    try:
        hash_, sep, size = data.decode("ascii").partition("/")
    except UnicodeDecodeError:
        return None
    if not sep or len(hash_) != 64 or not size.isdigit() or any(c not in "0123456789abcdef" for c in hash_):
        return None
    return hash_, int(size)


def asset_paths(label: str) -> tuple[str, str]:
    """The pin index paths of asset pin LABEL: (its content, its index entries)."""
    return f"{ASSET_DIR}/{label}{_ASSET_BLOB}", f"{ASSET_DIR}/{label}{_ASSET_ENTRIES}"


def asset_tree_path(label: str) -> str:
    """The pin index path of a directory asset pin's Tree (an OutputDirectory)."""
    return f"{ASSET_DIR}/{label}{_ASSET_TREE}"


def pinned_asset_trees(index: re_pb2.ActionResult) -> dict[str, re_pb2.Digest]:
    """{LABEL: Tree digest} of the directory asset pins of a pin index."""
    prefix = f"{ASSET_DIR}/"
    return {
        d.path[len(prefix) : -len(_ASSET_TREE)]: d.tree_digest
        for d in index.output_directories
        if d.path.startswith(prefix) and d.path.endswith(_ASSET_TREE) and d.path.count("/") == 2
    }


def pinned_assets(index: re_pb2.ActionResult) -> dict[str, re_pb2.Digest]:
    """{LABEL: content digest} of the asset pins of a pin index (a directory's: its root Directory)."""
    prefix = f"{ASSET_DIR}/"
    return {
        f.path[len(prefix) : -len(_ASSET_BLOB)]: f.digest
        for f in index.output_files
        if f.path.startswith(prefix) and f.path.endswith(_ASSET_BLOB)
    }


def asset_entry_blobs(index: re_pb2.ActionResult) -> list[re_pb2.Digest]:
    """Digests of the `assets/LABEL.entries` blobs of a pin index."""
    return [f.digest for f in index.output_files
            if f.path.startswith(f"{ASSET_DIR}/") and f.path.endswith(_ASSET_ENTRIES)]  # fmt: skip


def format_asset_entries(entries: list[Digest]) -> bytes:
    """An `.entries` blob: the key digest of each asset index entry a pin keeps."""
    return "".join(f"{d.function.label} {d.hash}/{d.size_bytes}\n" for d in entries).encode()


def parse_asset_entries(data: bytes) -> list[tuple[str, str, int]]:
    """(digest function label, hash, size) of each well-formed line of an `.entries` blob."""
    out = []
    for line in data.decode("ascii", "replace").splitlines():
        function, _, key = line.partition(" ")
        hash_, sep, size = key.partition("/")
        if function in _FUNCTIONS and sep and _HEX.match(hash_) and size.isdigit():
            out.append((function, hash_, int(size)))
    return out


def asset_namespace(namespace: str) -> str:
    """The asset index namespace of the instance whose pin index is in AC namespace `namespace`
    (`ac` -> `asset`, `ac/team` -> `asset/team`, as storage's `ac_namespace` names them)."""
    return "asset" + namespace[len("ac") :]
