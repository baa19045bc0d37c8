"""What `buildvault gc` must keep for golden versions (buildvault/pins.py).

A pin index is the action entry `ac/<ac namespace>/sha256/<pins.INDEX_DIGEST>` of an instance.
It never ages out, nor does the action entry of any artifact it pins (named by its `.key`
blobs), nor the asset index entries an asset pin names (its `.entries` blob). Their blobs are
kept as every kept entry's are: the pin index is itself an ActionResult whose output directories
are the pinned Trees (artifacts', and pinned directory assets' with their root Directory) and whose
output files are the `.key` blobs and each pinned asset's content and `.entries` blob; a pinned
directory asset's entry names the Directory blobs below its root.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from google.protobuf.message import DecodeError

from buildvault import pins
from buildvault.remote_apis import re_pb2

Get = Callable[[str], bytes | None]  # an object's bytes, None if it is gone


def entry_parts(relative: str) -> tuple[str, str, str] | None:
    """(AC namespace, digest function, hash) of `ac/<namespace...>/<fn>/<hash>`, None for other keys."""
    parts = relative.split("/")
    if len(parts) < 4 or parts[0] != "ac":
        return None
    return "/".join(parts[1:-2]), parts[-2], parts[-1]


def is_pin_index(relative: str) -> bool:
    parts = entry_parts(relative)
    if parts is None:
        return False
    namespace, function, hash_ = parts
    of_kind_ac = namespace == "ac" or namespace.startswith("ac/")
    return of_kind_ac and function == "sha256" and hash_ == pins.INDEX_DIGEST.hash


def pinned_entries(prefix: str, index_keys: Iterable[str], get: Get) -> set[str]:
    """Keys of the action entries pins hold: each pin index and every artifact entry it names.

    A pin index or `.key` blob that is gone or unreadable holds nothing more (gc goes on)."""
    held: set[str] = set()
    for index_key in index_keys:
        held.add(index_key)
        parts = entry_parts(index_key[len(prefix) :])
        data = get(index_key)
        if parts is None or data is None:
            continue
        try:
            index = re_pb2.ActionResult.FromString(data)
        except DecodeError:
            continue
        for key_blob in pins.key_blobs(index):
            if not key_blob.hash:
                continue
            text = get(f"{prefix}cas/sha256/{key_blob.hash}")
            key = pins.parse_artifact_key(text) if text is not None else None
            if key is not None:
                held.add(f"{prefix}ac/{parts[0]}/sha256/{key[0]}")
        for entries_blob in pins.asset_entry_blobs(index):
            text = get(f"{prefix}cas/sha256/{entries_blob.hash}") if entries_blob.hash else None
            for function, hash_, _size in pins.parse_asset_entries(text or b""):
                held.add(f"{prefix}ac/{pins.asset_namespace(parts[0])}/{function}/{hash_}")
    return held
