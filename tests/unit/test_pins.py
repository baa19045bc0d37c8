"""The pin index format's small parsers (buildvault/pins.py) and gc's reading of bucket keys."""

from __future__ import annotations

from buildvault import pins
from buildvault.admin import gc_pins

HASH = "ab" * 32


def test_parse_artifact_key() -> None:
    assert pins.parse_artifact_key(f"{HASH}/142".encode()) == (HASH, 142)
    for bad in (b"", HASH.encode(), f"{HASH}/".encode(), f"{HASH}/-1".encode(), f"{HASH[:-1]}/1".encode(),
                f"{HASH.upper()}/1".encode(), b"\xff" * 66):
        assert pins.parse_artifact_key(bad) is None, bad


def test_entry_parts_and_pin_index_keys() -> None:
    index = pins.INDEX_DIGEST.hash
    assert gc_pins.entry_parts(f"ac/ac/team/a/sha256/{HASH}") == ("ac/team/a", "sha256", HASH)
    assert gc_pins.entry_parts(f"cas/sha256/{HASH}") is None
    assert gc_pins.is_pin_index(f"ac/ac/sha256/{index}")
    assert gc_pins.is_pin_index(f"ac/ac/team/a/sha256/{index}")
    assert not gc_pins.is_pin_index(f"ac/raw/sha256/{index}")  # ccache's entries are never pin indexes
    assert not gc_pins.is_pin_index(f"ac/ac/blake3/{index}")
    assert not gc_pins.is_pin_index(f"ac/ac/sha256/{HASH}")


def test_asset_pin_entries_round_trip_and_reach_gc() -> None:
    from buildvault.digest import Digest, DigestFunction
    from buildvault.remote_apis import re_pb2

    keys = [Digest(HASH, 40, DigestFunction.SHA256), Digest("cd" * 32, 7, DigestFunction.BLAKE3)]
    data = pins.format_asset_entries(keys)
    assert pins.parse_asset_entries(data) == [("sha256", HASH, 40), ("blake3", "cd" * 32, 7)]
    # Malformed lines are skipped, the good ones kept.
    assert pins.parse_asset_entries(b"md5 x/1\nsha256 " + HASH.encode() + b"/-1\n\xff\n" + data) == [
        ("sha256", HASH, 40), ("blake3", "cd" * 32, 7)]  # fmt: skip
    assert pins.asset_namespace("ac") == "asset" and pins.asset_namespace("ac/team/a") == "asset/team/a"

    blob_path, entries_path = pins.asset_paths("golden")
    content = re_pb2.Digest(hash="ef" * 32, size_bytes=100)
    entries = re_pb2.Digest(hash="01" * 32, size_bytes=len(data))
    index = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path=blob_path, digest=content),
                                              re_pb2.OutputFile(path=entries_path, digest=entries)])  # fmt: skip
    assert pins.pinned_assets(index) == {"golden": content}
    assert pins.asset_entry_blobs(index) == [entries]
    assert pins.key_blobs(index) == []  # never read as an artifact's key

    prefix = "p/"
    index_key = f"{prefix}ac/ac/team/sha256/{pins.INDEX_DIGEST.hash}"
    objects = {index_key: index.SerializeToString(), f"{prefix}cas/sha256/{entries.hash}": data}
    assert gc_pins.pinned_entries(prefix, [index_key], objects.get) == {
        index_key, f"{prefix}ac/asset/team/sha256/{HASH}", f"{prefix}ac/asset/team/blake3/{'cd' * 32}"}  # fmt: skip
    del objects[f"{prefix}cas/sha256/{entries.hash}"]  # the entries blob is gone: the index holds itself
    assert gc_pins.pinned_entries(prefix, [index_key], objects.get) == {index_key}


def test_a_directory_asset_pin_is_an_asset_never_an_artifact_pin() -> None:
    from buildvault.remote_apis import re_pb2

    tree, root, artifact = (re_pb2.Digest(hash=c * 64, size_bytes=9) for c in "abc")
    blob_path, _ = pins.asset_paths("golden")
    index = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path=blob_path, digest=root)],
        output_directories=[re_pb2.OutputDirectory(path=pins.asset_tree_path("golden"), tree_digest=tree,
                                                   root_directory_digest=root),
                            re_pb2.OutputDirectory(path="assets/golden", tree_digest=artifact)],  # an artifact "assets"
    )  # fmt: skip
    assert pins.asset_tree_path("golden") == "assets/golden/tree"
    assert pins.pinned_trees(index) == {"assets/golden": artifact}
    assert pins.pinned_asset_trees(index) == {"golden": tree}
    assert pins.pinned_assets(index) == {"golden": root}
