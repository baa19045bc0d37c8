"""Read and write an instance's pin index (buildvault/pins.py) through a Remote: the
read-modify-write `buildvault artifact pin` and `buildvault asset pin` share."""

from __future__ import annotations

from buildvault import pins
from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

from .remote import Remote

__all__ = ["read_index", "set_asset_pin", "remove_asset_pin", "write_index"]


def read_index(remote: Remote) -> re_pb2.ActionResult:
    return remote.get_action_result(pins.INDEX_DIGEST) or re_pb2.ActionResult()


def write_index(remote: Remote, index: re_pb2.ActionResult) -> None:
    blobs = {pins.INDEX_DIGEST: pins.INDEX_ACTION, Digest.of(pins.INDEX_COMMAND_BLOB): pins.INDEX_COMMAND_BLOB}
    remote.upload({d: blobs[d] for d in remote.find_missing(blobs)})
    remote.update_action_result(pins.INDEX_DIGEST, index)


def _without_asset(index: re_pb2.ActionResult, label: str) -> re_pb2.ActionResult:
    paths = set(pins.asset_paths(label))
    tree_path = pins.asset_tree_path(label)
    kept = re_pb2.ActionResult()
    kept.output_directories.extend(d for d in index.output_directories if d.path != tree_path)
    kept.output_files.extend(f for f in index.output_files if f.path not in paths)
    return kept


def set_asset_pin(
    remote: Remote, label: str, content: Digest, entries: list[Digest], tree: bytes | None = None
) -> None:
    """Add (or move) asset pin LABEL: keep the blob `content` and the asset index entries whose
    keys are `entries` (read-modify-write of the index). For a directory asset, `content` is its
    root Directory and `tree` a serialized Tree of it: the pin keeps every blob the Tree names,
    as an artifact pin's Tree does."""
    data = pins.format_asset_entries(entries)
    blobs = {Digest.of(data): data}
    if tree is not None:
        blobs[Digest.of(tree)] = tree
    remote.upload({d: blobs[d] for d in remote.find_missing(blobs)})  # before the index names them
    kept = _without_asset(read_index(remote), label)
    blob_path, entries_path = pins.asset_paths(label)
    kept.output_files.add(path=blob_path, digest=content.to_proto(re_pb2.Digest))
    kept.output_files.add(path=entries_path, digest=Digest.of(data).to_proto(re_pb2.Digest))
    if tree is not None:
        kept.output_directories.add(
            path=pins.asset_tree_path(label),
            tree_digest=Digest.of(tree).to_proto(re_pb2.Digest),
            root_directory_digest=content.to_proto(re_pb2.Digest),
        )
    write_index(remote, kept)


def remove_asset_pin(remote: Remote, label: str) -> bool:
    index = read_index(remote)
    if label not in pins.pinned_assets(index):
        return False
    write_index(remote, _without_asset(index, label))
    return True
