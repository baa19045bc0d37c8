"""Damage done to a disk store's records (storage/disk/records.py) from outside the server
process, as bit rot, a hand edit or `buildvault verify --repair` would: a byte flipped in the
LMDB data file, a record removed or replaced by a shorter one. LMDB allows other processes to
open the environment beside a running server; never open it in the process that runs the store."""

from __future__ import annotations

import mmap
from pathlib import Path

import lmdb

from buildvault.digest import Digest
from buildvault.storage.disk.core import cas_key

MAP_SIZE = 1 << 34  # at least the server's map: LMDB keeps the larger


def data_file(root: Path) -> Path:
    return root / "records" / "data.mdb"


def flip_byte_of(root: Path, data: bytes) -> None:
    """Flip one bit in the middle of every copy of `data` in the data file the server has mapped,
    in place (a small record lives in a leaf page, and copy-on-write leaves stale copies of leaf
    pages in free pages: flipping every copy hits the live one)."""
    path = data_file(root)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        at = mapped.find(data)
        assert at >= 0, "the record's bytes are not in the data file"
        while at >= 0:
            mapped[at + len(data) // 2] ^= 0x01
            at = mapped.find(data, at + len(data))
        mapped.flush()


def _env(root: Path) -> lmdb.Environment:
    return lmdb.open(str(root / "records"), map_size=MAP_SIZE, sync=False, metasync=False, readahead=False)


def remove_record(root: Path, digest: Digest) -> None:
    env = _env(root)
    try:
        with env.begin(write=True) as txn:
            assert txn.delete(cas_key(digest)), "no such record"
    finally:
        env.close()


def truncate_record(root: Path, digest: Digest) -> None:
    """Replace the record's value by one byte shorter (CRC and length then disagree)."""
    env = _env(root)
    try:
        with env.begin(write=True) as txn:
            key = cas_key(digest)
            value = txn.get(key)
            assert value is not None, "no such record"
            txn.put(key, value[:-1])
    finally:
        env.close()


def record_count(root: Path) -> int:
    env = lmdb.open(str(root / "records"), readonly=True, lock=True, map_size=MAP_SIZE)
    try:
        return int(env.stat()["entries"])
    finally:
        env.close()


def zero_record(root: Path, key: bytes) -> None:
    """Overwrite a record's value with zeros (its CRC then fails), as a torn write would leave a file."""
    env = _env(root)
    try:
        with env.begin(write=True) as txn:
            value = txn.get(key)
            assert value is not None, "no such record"
            txn.put(key, b"\x00" * len(value))
    finally:
        env.close()


def all_records(root: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(root / "records"), readonly=True, lock=True, map_size=MAP_SIZE)
    try:
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


def record_data(root: Path, key: bytes) -> bytes | None:
    """A record's data (without its CRC), or None."""
    value = all_records(root).get(key)
    return None if value is None else value[4:]
