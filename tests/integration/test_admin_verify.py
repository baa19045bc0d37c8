"""`buildvault verify` on the data directory of a running server.

The server stores blobs and ActionResults over HTTP (small ones: records in LMDB, damaged
through record_damage.py); then they are damaged behind its back: one blob's bytes flipped
(corrupt), one referenced blob removed (its entry now dangles), one entry zero-filled (a torn
write). Reports name a record by the path its file would have under records/. verify reports
exactly those, changes nothing without --repair, removes exactly those with it, and the next
verify is clean; the server keeps answering throughout. With the server's bucket configured,
--repair fetches damaged and missing blobs back from the bucket (the S3 test server), keeping
only those that match their digest.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import s3_server
from record_damage import all_records, flip_byte_of, record_data, remove_record, zero_record
from s3_server import REGION, raw_client, tier_args, wait_drained

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2
from buildvault.storage.chunks.chunker import ChunkingParams, cut
from buildvault.storage.disk.core import AcKeys, cas_key

# Fixtures bound by assignment: a parameter requesting one is no redefinition to the linter.
aws_env = s3_server.aws_env
s3_endpoint = s3_server.s3_endpoint
bucket = s3_server.bucket

CLI = [sys.executable, "-m", "buildvault.cli"]


def _put(base: str, path: str, data: bytes) -> None:
    request = urllib.request.Request(f"{base}{path}", data=data, method="PUT")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status in (200, 201, 204)


def _verify(data_dir: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run([*CLI, "verify", "--dir", str(data_dir), "--json", *extra], capture_output=True, text=True)
    assert proc.stderr == "", proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _blob_path(data_dir: Path, data: bytes) -> Path:
    """How reports name a small blob: its record, as the path its file would have under records/."""
    digest = hashlib.sha256(data).hexdigest()
    return data_dir / "records" / "cas" / "sha256" / digest[:2] / f"{digest}-{len(data)}"


def _entry_path(data_dir: Path, action_hash: str) -> Path:
    return data_dir / "records" / "ac" / "ac" / "@sha256" / action_hash[:2] / action_hash


def _blob_key(data: bytes) -> bytes:
    return cas_key(Digest.of(data))


def _entry_key(action_hash: str) -> bytes:
    return AcKeys().key("ac", Digest(action_hash, 0))


def _has(data_dir: Path, key: bytes) -> bool:
    return record_data(data_dir, key) is not None


def _store_action(base: str, output: bytes, name: str) -> str:
    """An ActionResult with one output file over HTTP; returns the action hash."""
    output_hash = hashlib.sha256(output).hexdigest()
    _put(base, f"/cas/{output_hash}", output)
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path=name, digest=re_pb2.Digest(hash=output_hash, size_bytes=len(output)))]
    )
    action_hash = hashlib.sha256(name.encode()).hexdigest()
    _put(base, f"/ac/{action_hash}", result.SerializeToString())
    return action_hash


def test_verify_finds_and_repairs_damage_beside_a_running_server(buildvault_server) -> None:
    base = f"http://{buildvault_server.http_address}"
    data_dir = Path(buildvault_server.data_dir)
    blobs = [os.urandom(1000 + i * 37) for i in range(200)]
    for blob in blobs:
        _put(base, f"/cas/{hashlib.sha256(blob).hexdigest()}", blob)
    intact = _store_action(base, b"intact output\n", "intact")
    dangling = _store_action(base, b"output that will vanish\n", "dangling")
    torn = _store_action(base, b"output of a torn entry\n", "torn")

    code, report = _verify(data_dir)
    assert code == 0, report
    assert report["blobs"] == len(blobs) + 3 and report["action_entries"] == 3
    assert report["corrupt_blobs"] == report["broken_entries"] == report["dangling_entries"] == []

    corrupt = _blob_path(data_dir, blobs[7])
    flip_byte_of(data_dir, blobs[7])
    remove_record(data_dir, Digest.of(b"output that will vanish\n"))
    torn_path = _entry_path(data_dir, torn)
    zero_record(data_dir, _entry_key(torn))

    code, report = _verify(data_dir)
    assert code == 1
    assert report["corrupt_blobs"] == [str(corrupt)]
    assert report["dangling_entries"] == [str(_entry_path(data_dir, dangling))]
    assert report["broken_entries"] == [str(torn_path)]
    assert _has(data_dir, _blob_key(blobs[7])) and _has(data_dir, _entry_key(torn))  # nothing changes

    code, report = _verify(data_dir, "--repair")
    assert code == 0 and report["removed"] == 3, report
    assert not _has(data_dir, _blob_key(blobs[7])) and not _has(data_dir, _entry_key(torn))
    assert not _has(data_dir, _entry_key(dangling))
    assert _has(data_dir, _entry_key(intact))

    code, report = _verify(data_dir)
    assert code == 0 and report["blobs"] == len(blobs) + 1 and report["action_entries"] == 1, report
    with urllib.request.urlopen(f"{base}/ac/{intact}", timeout=10) as response:
        assert response.status == 200  # the server never stopped answering


def test_verify_plain_summary_line_and_bad_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    proc = subprocess.run([*CLI, "verify", "--dir", str(missing)], capture_output=True, text=True)
    assert proc.returncode == 2 and "--dir" in proc.stderr and str(missing) in proc.stderr
    assert not missing.exists()
    not_a_store = tmp_path / "plain"
    not_a_store.mkdir()
    proc = subprocess.run([*CLI, "verify", "--dir", str(not_a_store)], capture_output=True, text=True)
    assert proc.returncode == 2 and "not a buildvault data directory" in proc.stderr
    assert list(not_a_store.iterdir()) == []
    (tmp_path / "store" / "cas").mkdir(parents=True)
    proc = subprocess.run([*CLI, "verify", "--dir", str(tmp_path / "store")], capture_output=True, text=True)
    assert proc.returncode == 0
    assert proc.stdout.startswith("verified 0 blobs") and proc.stdout.count("\n") == 1  # no bar off a terminal


def test_repair_refetches_damaged_and_missing_blobs_from_the_bucket(
    s3_endpoint: str, bucket: str, buildvault_server_factory
) -> None:
    server = buildvault_server_factory("server", extra_args=tier_args(s3_endpoint, bucket))
    base = f"http://{server.http_address}"
    data_dir = Path(server.data_dir)
    outputs = {name: f"output of {name}\n".encode() * 50 for name in ("damaged", "missing", "bad-in-bucket")}
    actions = {name: _store_action(base, data, name) for name, data in outputs.items()}
    wait_drained(server.http_address)  # everything is in the bucket
    damaged, missing, bad = (_blob_path(data_dir, outputs[n]) for n in ("damaged", "missing", "bad-in-bucket"))
    for name in ("damaged", "bad-in-bucket"):
        flip_byte_of(data_dir, outputs[name])
    remove_record(data_dir, Digest.of(outputs["missing"]))
    bad_hash = hashlib.sha256(outputs["bad-in-bucket"]).hexdigest()
    raw_client(s3_endpoint).put_object(Bucket=bucket, Key=f"cas/sha256/{bad_hash}", Body=b"not the blob")
    s3_flags = ("--s3-endpoint", s3_endpoint, "--s3-bucket", bucket, "--s3-region", REGION)

    before = all_records(data_dir)
    proc = subprocess.run(
        [*CLI, "verify", "--dir", str(data_dir), "--repair", "--s3-endpoint", "http://127.0.0.1:9",
         "--s3-bucket", bucket, "--s3-region", REGION], capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and "--s3-endpoint" in proc.stderr, proc.stderr
    assert all_records(data_dir) == before

    code, report = _verify(data_dir, "--repair", *s3_flags)
    assert code == 0, report
    assert sorted(report["corrupt_blobs"]) == sorted([str(damaged), str(bad)])
    assert report["restored_blobs"] == [str(damaged)] and report["refetched"] == 2
    assert report["restored_entries"] == [str(_entry_path(data_dir, actions["missing"]))]
    assert report["dangling_entries"] == [str(_entry_path(data_dir, actions["bad-in-bucket"]))]
    assert record_data(data_dir, _blob_key(outputs["damaged"])) == outputs["damaged"]
    assert record_data(data_dir, _blob_key(outputs["missing"])) == outputs["missing"]
    assert not _has(data_dir, _blob_key(outputs["bad-in-bucket"]))
    assert not _has(data_dir, _entry_key(actions["bad-in-bucket"]))
    assert not list((data_dir / "tmp").glob("verify-*"))

    code, report = _verify(data_dir)
    assert code == 0 and report["corrupt_blobs"] == report["dangling_entries"] == [], report
    assert report["action_entries"] == 2
    for name in ("damaged", "missing"):
        with urllib.request.urlopen(f"{base}/ac/{actions[name]}", timeout=10) as response:
            output = re_pb2.ActionResult.FromString(response.read()).output_files[0]
        with urllib.request.urlopen(f"{base}/cas/{output.digest.hash}", timeout=10) as response:
            assert response.read() == outputs[name]


def _blobs_whose_chunks_are_files(params: ChunkingParams) -> tuple[bytes, bytes, bytes]:
    """Three 3 MiB blobs (the second sharing the first's first 2 MiB) none of whose chunks is small
    enough to be an LMDB record (a blob's last chunk is whatever is left, so it can be tiny): the
    test damages chunk files. Seeded, so every run uses the same blobs."""
    for seed in range(100):
        rng = random.Random(seed)
        kept = rng.randbytes(3 << 20)
        sibling = kept[: 2 << 20] + rng.randbytes(1 << 20)  # shares kept's first chunks
        damaged = rng.randbytes(3 << 20)
        if all(len(c) > 64 << 10 for blob in (kept, sibling, damaged) for c in cut(blob, params)):
            return kept, sibling, damaged
    raise AssertionError("no seed below 100 gives chunks that are all files")


def _chunk_path(data_dir: Path, chunk: bytes) -> Path:
    digest = hashlib.sha256(chunk).hexdigest()
    return data_dir / "cas" / "sha256" / digest[:2] / f"{digest}-{len(chunk)}"


def _list_path(data_dir: Path, blob: bytes) -> Path:
    digest = hashlib.sha256(blob).hexdigest()
    return data_dir / "records" / "ac" / "chunks" / "@sha256" / digest[:2] / digest


def _read(base: str, blob: bytes) -> str:
    """ "whole", "missing" (404) or "cut" (the server found a chunk gone mid-stream)."""
    try:
        with urllib.request.urlopen(f"{base}/cas/{hashlib.sha256(blob).hexdigest()}", timeout=30) as response:
            assert response.read() == blob  # never other bytes
            return "whole"
    except urllib.error.HTTPError as error:
        assert error.code == 404
        return "missing"
    except http.client.IncompleteRead:
        return "cut"


def test_verify_checks_chunk_lists_and_their_chunks(buildvault_server) -> None:
    """Blobs of at least 2 MiB are kept as chunks plus a list (storage/chunks). An ActionResult
    naming one is not dangling; a list whose chunk is damaged or missing is dangling and --repair
    removes it (the damaged chunk too), leaving the lists and chunks the other blobs need."""
    base = f"http://{buildvault_server.http_address}"
    data_dir = Path(buildvault_server.data_dir)
    params = ChunkingParams()
    kept, sibling, damaged = _blobs_whose_chunks_are_files(params)
    for blob in (kept, sibling, damaged):
        _put(base, f"/cas/{hashlib.sha256(blob).hexdigest()}", blob)
    action = hashlib.sha256(b"links kept").hexdigest()
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path="out.so", digest=Digest.of(kept).to_proto(re_pb2.Digest))]
    )
    _put(base, f"/ac/{action}", result.SerializeToString())
    buildvault_server.wait_chunked()  # chunked after the write
    chunks = {
        name: [bytes(c) for c in cut(blob, params)] for name, blob in (("k", kept), ("s", sibling), ("d", damaged))
    }
    assert chunks["k"][0] == chunks["s"][0] and chunks["s"][-1] not in chunks["k"]
    assert all(_chunk_path(data_dir, c).is_file() for c in chunks["k"] + chunks["s"] + chunks["d"])

    code, report = _verify(data_dir)
    assert code == 0, report
    assert report["chunk_lists"] == 3 and report["action_entries"] == 4
    assert report["dangling_entries"] == report["broken_entries"] == report["corrupt_blobs"] == []

    flipped = _chunk_path(data_dir, chunks["d"][1])
    with open(flipped, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    _chunk_path(data_dir, chunks["s"][-1]).unlink()

    code, report = _verify(data_dir)
    assert code == 1, report
    assert report["corrupt_blobs"] == [str(flipped)]
    assert sorted(report["dangling_entries"]) == sorted(
        [str(_list_path(data_dir, sibling)), str(_list_path(data_dir, damaged))]
    )
    assert report["broken_entries"] == []
    assert flipped.is_file()  # nothing changes without --repair

    code, report = _verify(data_dir, "--repair")
    assert code == 0 and report["removed"] == 3, report
    code, report = _verify(data_dir)
    assert code == 0 and report["chunk_lists"] == 1 and report["action_entries"] == 2, report
    # The server, whose index still lists what was removed behind its back, finds out at the
    # latest on the first read (cut short, never other bytes) and reports the blob missing next.
    assert _read(base, kept) == "whole"
    for blob in (sibling, damaged):
        assert _read(base, blob) in ("missing", "cut")
        assert _read(base, blob) == "missing"
    with urllib.request.urlopen(f"{base}/ac/{action}", timeout=10) as response:
        assert response.status == 200  # its output, kept as chunks, is whole
