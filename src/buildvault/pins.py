"""Golden versions: the pin index that clients write and the server protects.

The index is an ordinary ActionCache entry, so any REAPI cache can hold it: its key is the
digest of a fixed Action (`INDEX_DIGEST`, Command `buildvault-pins/1`), one per instance.
Each pin is an OutputDirectory `NAME/LABEL` whose Tree is the pinned artifact's whole tree,
plus an OutputFile `NAME/LABEL.key` holding the artifact's key (`hash/size`). A server that
knows this format keeps every blob an index names (the Tree blobs and every file in them).
"""

from __future__ import annotations

import re

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

INDEX_COMMAND = "buildvault-pins/1"
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
    """{"NAME/LABEL": Tree digest} of a pin index."""
    return {d.path: d.tree_digest for d in index.output_directories}


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
