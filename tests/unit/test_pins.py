"""The pin index format's small parsers (buildvault/pins.py) and gc's reading of bucket keys."""

from __future__ import annotations

from buildvault import pins
from buildvault.admin import gc_pins

HASH = "ab" * 32


def test_parse_artifact_key() -> None:
    assert pins.parse_artifact_key(f"{HASH}/142".encode()) == (HASH, 142)
    for bad in (
        b"",
        HASH.encode(),
        f"{HASH}/".encode(),
        f"{HASH}/-1".encode(),
        f"{HASH[:-1]}/1".encode(),
        f"{HASH.upper()}/1".encode(),
        b"\xff" * 66,
    ):
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
