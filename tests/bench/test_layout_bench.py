"""bench/layout_bench.py for correctness only (its figures are not asserted): every candidate
that needs no extra package returns every acknowledged blob after its writer is killed with
SIGKILL, and the pack candidate's recovery cuts a torn tail and a flipped byte instead of
serving them. The LMDB candidate needs the `bench` extra and is left to the benchmark itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import layout_bench  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_every_acknowledged_blob_survives_kill_9(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "layout_bench.py"), "--blobs", "300", "--singles", "20",
         "--extra-batches", "1", "--only", "files,pack,sqlite-wal", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr  # it exits non-zero on a lost blob
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["candidate"] for r in rows] == ["files", "pack", "sqlite-wal"]
    for row in rows:
        assert row["blobs_acked_before_kill"] >= 300 + 20 + 100
        assert row["batch_write_us"] > 0 and row["batch_read_us"] > 0


def _items(start: int, stop: int) -> list[tuple[bytes, bytes]]:
    return layout_bench.items_for(start, stop)


def _stop_uncleanly(store: layout_bench.PackStore) -> None:
    """As a SIGKILL leaves it: no snapshot, SYNC still says running."""
    store.syncer.stop()
    os.close(store.fd)


def test_pack_recovery_cuts_a_torn_tail(tmp_path: Path) -> None:
    store = layout_bench.PackStore(tmp_path)
    items = _items(0, 3)
    store.write_batch(items)
    intact_end = store.tail
    _stop_uncleanly(store)
    with open(tmp_path / "pack-0000.dat", "ab") as pack:  # a record whose data never arrived
        header = layout_bench.PackStore.HEADER.pack(layout_bench.PackStore.MAGIC, 4096, b"\x01" * 32, 0)
        pack.write(header + b"\x00" * 100)
    reopened = layout_bench.PackStore(tmp_path)
    assert os.path.getsize(tmp_path / "pack-0000.dat") == intact_end
    assert sorted(reopened.index) == sorted(d for d, _ in items)
    assert reopened.read_batch([d for d, _ in items]) == [data for _, data in items]
    reopened.write_batch(_items(3, 4))  # appends where the intact records end
    assert reopened.tail > intact_end
    reopened.close()


def test_pack_never_serves_a_flipped_byte(tmp_path: Path) -> None:
    store = layout_bench.PackStore(tmp_path)
    items = _items(0, 3)
    store.write_batch(items)
    second_offset, _size = store.index[items[1][0]]
    store.close()
    with open(tmp_path / "pack-0000.dat", "r+b") as pack:
        pack.seek(second_offset + 10)
        byte = pack.read(1)
        pack.seek(second_offset + 10)
        pack.write(bytes([byte[0] ^ 0xFF]))
    clean = layout_bench.PackStore(tmp_path)  # clean open trusts the snapshot; the read checks
    assert clean.read_batch([items[0][0]]) == [items[0][1]]
    with pytest.raises(layout_bench.Corrupt):
        clean.read_batch([items[1][0]])
    _stop_uncleanly(clean)
    (tmp_path / "index.snap").unlink()  # an unclean stop before any snapshot: the scan decides
    rescanned = layout_bench.PackStore(tmp_path)
    assert list(rescanned.index) == [items[0][0]]  # cut at the first bad record
    assert hashlib.sha256(rescanned.read_batch([items[0][0]])[0]).digest() == items[0][0]
    rescanned.close()
