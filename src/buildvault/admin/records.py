"""The admin side of a disk store's records (storage/disk/records.py): `verify` re-hashes them
and `--repair` removes or (with a bucket) rewrites them, beside a running server.

LMDB lets several processes use one environment: readers never block the server, and a write
(a removal or a rewrite by --repair) takes LMDB's own writer lock, so it never interleaves with
the server's commits. Records are read in short transactions of READ_BATCH records (a long one
would keep the server from reusing freed pages); a removal or rewrite happens only if the
record still holds the bytes that were checked. A record is named in reports by the path its
file would have under `<dir>/records/` (records/cas/<fn>/<hh>/<hash>-<size>,
records/ac/<namespace>/@<fn>/<hh>/<hash>): no such file exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import lmdb

from buildvault.digest import DigestFunction
from buildvault.storage.disk import records as store_records
from buildvault.storage.disk.core import Layout, cas_size
from buildvault.storage.disk.layout import AC_TAG, FN_BY_BYTE, FN_BYTE, SIZE_BYTES, kind_of

READ_BATCH = 1024


class Record(NamedTuple):
    key: bytes
    value: bytes  # as stored: CRC-32 + data

    @property
    def data(self) -> bytes:
        return self.value[4:]


class AdminRecords:
    """The records of the store at `root` (none if it has no environment)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._layout = Layout(root / "records")
        path = root / "records"
        self.env: lmdb.Environment | None = None
        data = path / "data.mdb"
        if data.is_file():
            map_size = max(2 * data.stat().st_size, 64 << 20)
            self.env = lmdb.open(
                str(path), map_size=map_size, create=False, sync=False, metasync=False, readahead=False
            )

    def close(self) -> None:
        if self.env is not None:
            self.env.sync(True)
            self.env.close()
            self.env = None

    def label(self, key: bytes) -> str:
        return self._layout.path(key)

    def _scan(self, prefix: bytes) -> Iterator[Record]:
        """Records whose key starts with `prefix`, in key order, READ_BATCH per transaction."""
        env = self.env
        if env is None:
            return
        start = prefix
        while True:
            batch: list[Record] = []
            with env.begin() as txn:
                cursor = txn.cursor()
                if not cursor.set_range(start):
                    return
                for key, value in cursor.iternext():
                    if not key.startswith(prefix):
                        break
                    batch.append(Record(key, value))
                    if len(batch) >= READ_BATCH:
                        break
            yield from batch
            if len(batch) < READ_BATCH:
                return
            start = batch[-1].key + b"\x00"  # the next key after it

    def blobs(self) -> Iterator[tuple[Record, DigestFunction, str, int, bool]]:
        """Every CAS record: (record, function, hex hash, size, intact)."""
        for fn_byte in FN_BYTE.values():
            for record in self._scan(fn_byte):
                key = record.key
                if len(key) != 33 + SIZE_BYTES:
                    continue
                intact = store_records.check_record(key, record.value)
                yield record, FN_BY_BYTE[key[0]], key[1:33].hex(), cas_size(key), intact

    def entries(self) -> Iterator[tuple[Record, str, DigestFunction, bool]]:
        """Every action entry record: (record, kind, function, CRC intact)."""
        for record in self._scan(bytes([AC_TAG])):
            key = record.key
            yield record, kind_of(key), FN_BY_BYTE[key[-33]], store_records.check_record(key, record.value)

    def blob(self, function: DigestFunction, hex_hash: str, size: int) -> bytes | None:
        """The intact data of a CAS record, or None."""
        if self.env is None:
            return None
        key = FN_BYTE[function] + bytes.fromhex(hex_hash) + size.to_bytes(SIZE_BYTES, "big")
        with self.env.begin() as txn:
            value = txn.get(key)
        if value is None or not store_records.check_record(key, value):
            return None
        return bytes(value[4:])

    def remove_if_unchanged(self, record: Record) -> bool:
        """Delete the record if it still holds the bytes that were checked."""
        if self.env is None:
            return False
        with self.env.begin(write=True) as txn:
            if txn.get(record.key) != record.value:
                return False
            return bool(txn.delete(record.key))

    def restore(self, function: DigestFunction, hex_hash: str, size: int, data: bytes, replacing: bytes | None) -> bool:
        """Write a verified blob as its record, if the record still holds `replacing` (None: absent)."""
        if self.env is None:
            return False
        key = FN_BYTE[function] + bytes.fromhex(hex_hash) + size.to_bytes(SIZE_BYTES, "big")
        with self.env.begin(write=True) as txn:
            if txn.get(key) != replacing:
                return False
            txn.put(key, store_records.crc_of(data) + data)
        return True

    def holds(self, size: int) -> bool:
        """Whether a blob of `size` bytes is a record in this store (else a file)."""
        return self.env is not None and size <= store_records.RECORD_LIMIT
