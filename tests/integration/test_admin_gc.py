"""`buildvault gc` against the S3 test server (moto) with a few thousand objects.

Object ages are set in moto's state (LastModified is what gc reads as "last used"). The bucket
holds referenced blobs, blobs of expired entries, old unreferenced blobs, young unreferenced
blobs (uploads in flight), and raw entries. A dry run changes nothing; a real run deletes
exactly what the rules say; an interrupted run leaves every remaining entry complete; a server
writing while gc runs still serves only complete results afterwards.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import s3_server
from polling import wait_for
from s3_server import REGION, bucket_keys, raw_client, s3_requests, tier_args, wait_drained

from buildvault import cli, pins
from buildvault.admin import gc
from buildvault.remote_apis import re_pb2

# Fixtures bound by assignment: a parameter requesting one is no redefinition to the linter.
aws_env = s3_server.aws_env
s3_endpoint = s3_server.s3_endpoint
bucket = s3_server.bucket

NOW = datetime.datetime.now(datetime.UTC)
DAY = datetime.timedelta(days=1)


class Seeder:
    """Objects straight into moto's state, each with the age a test gives it."""

    def __init__(self, bucket: str) -> None:
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        self.backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        self.bucket = bucket

    def put(self, key: str, data: bytes, age: datetime.timedelta) -> str:
        stored = self.backend.put_object(self.bucket, key, data)
        stored.last_modified = (NOW - age).replace(tzinfo=None)
        return key

    def blob(self, age: datetime.timedelta) -> tuple[str, re_pb2.Digest]:
        data = os.urandom(64)
        digest = re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
        return self.put(f"cas/sha256/{digest.hash}", data, age), digest

    def entry(self, digests: list[re_pb2.Digest], age: datetime.timedelta) -> str:
        result = re_pb2.ActionResult(
            output_files=[re_pb2.OutputFile(path=f"out/{i}", digest=d) for i, d in enumerate(digests)]
        )
        action = hashlib.sha256(os.urandom(16)).hexdigest()
        return self.put(f"ac/ac/sha256/{action}", result.SerializeToString(), age)


def _seed_artifact(s: Seeder, namespace: str, age: datetime.timedelta) -> tuple[set[str], str, re_pb2.Digest]:
    """An artifact entry (a Tree of 3 files) and its blobs, all `age` old: (its keys, entry key, entry digest)."""
    files = [s.blob(age) for _ in range(3)]
    nodes = [re_pb2.FileNode(name=f"f{i}", digest=d) for i, (_, d) in enumerate(files)]
    tree = re_pb2.Tree(root=re_pb2.Directory(files=nodes))
    tree_data = tree.SerializeToString()
    tree_digest = re_pb2.Digest(hash=hashlib.sha256(tree_data).hexdigest(), size_bytes=len(tree_data))
    tree_key = s.put(f"cas/sha256/{tree_digest.hash}", tree_data, age)
    result = re_pb2.ActionResult(output_directories=[re_pb2.OutputDirectory(path="artifact", tree_digest=tree_digest)])
    data = result.SerializeToString()
    action = re_pb2.Digest(hash=hashlib.sha256(os.urandom(16)).hexdigest(), size_bytes=142)
    entry_key = s.put(f"ac/{namespace}/sha256/{action.hash}", data, age)
    return {k for k, _ in files} | {tree_key, entry_key}, entry_key, action


def _seed_pin(
    s: Seeder, namespace: str, pinned: dict[str, tuple[str, re_pb2.Digest]], age: datetime.timedelta
) -> set[str]:
    """The pin index of `namespace` as `buildvault artifact pin` writes it: {"NAME/LABEL": (entry key, key)}."""
    index = re_pb2.ActionResult()
    keys: set[str] = set()
    for path, (entry_key, action) in pinned.items():
        entry = re_pb2.ActionResult.FromString(s.backend.get_object(s.bucket, entry_key).value)
        index.output_directories.add(path=path, tree_digest=entry.output_directories[0].tree_digest)
        key_data = f"{action.hash}/{action.size_bytes}".encode()
        key_digest = re_pb2.Digest(hash=hashlib.sha256(key_data).hexdigest(), size_bytes=len(key_data))
        keys.add(s.put(f"cas/sha256/{key_digest.hash}", key_data, age))
        index.output_files.add(path=f"{path}.key", digest=key_digest)
    keys.add(s.put(f"ac/{namespace}/sha256/{pins.INDEX_DIGEST.hash}", index.SerializeToString(), age))
    return keys


def test_gc_never_deletes_what_a_pin_holds_in_any_instance(
    s3_endpoint: str, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Seeder(bucket)
    old = 90 * DAY
    held: set[str] = set()
    for namespace in ("ac", "ac/team-a", "ac/nested/instance"):
        pinned_keys, entry_key, action = _seed_artifact(s, namespace, old)
        held |= pinned_keys | _seed_pin(s, namespace, {"firmware/golden": (entry_key, action)}, old)
    unpinned, _, _ = _seed_artifact(s, "ac/team-a", old)  # the same shape, no pin: it goes
    # A pin index naming a key blob that is gone, or holding garbage, protects itself and no more.
    held.add(s.put(f"ac/ac/team-b/sha256/{pins.INDEX_DIGEST.hash}", b"\xff not a message", old))
    gone = re_pb2.Digest(hash="0" * 64, size_bytes=3)
    broken = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="x/y.key", digest=gone)])
    held.add(s.put(f"ac/ac/team-c/sha256/{pins.INDEX_DIGEST.hash}", broken.SerializeToString(), old))

    code, plan = _gc(s3_endpoint, bucket, "--max-age", "30d", "--grace", "1h", capsys=capsys)
    assert code == 0, plan
    assert plan["pinned_entries"] == 8  # 5 pin indexes + 3 pinned artifact entries
    assert bucket_keys(s3_endpoint, bucket) == held
    assert unpinned.isdisjoint(bucket_keys(s3_endpoint, bucket))


def test_gc_keeps_an_entry_a_server_keeps_serving(
    s3_endpoint: str,
    bucket: str,
    buildvault_server_factory: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    s = Seeder(bucket)
    blobs = [s.blob(40 * DAY) for _ in range(3)]
    served = s.entry([d for _, d in blobs], 40 * DAY)
    unused_blobs = [s.blob(40 * DAY) for _ in range(3)]
    unused = s.entry([d for _, d in unused_blobs], 40 * DAY)
    server = buildvault_server_factory("server", extra_args=tier_args(s3_endpoint, bucket))
    url = f"http://{server.http_address}/ac/{served.rsplit('/', 1)[1]}"
    for _ in range(3):  # a read-through, then hits from the server's disk
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
    # The request is counted when it is sent: wait for its effect in the bucket.
    recent = (NOW - DAY).replace(tzinfo=None)
    wait_for(lambda: s.backend.get_object(bucket, served).last_modified > recent, 30, "the served entry renewed")
    assert s3_requests(server.http_address).get("copy") == 1

    code, plan = _gc(s3_endpoint, bucket, "--max-age", "30d", capsys=capsys)
    assert code == 0 and plan["expired_entries"] == 1 and plan["blobs_removed"] == 3, plan
    keys = bucket_keys(s3_endpoint, bucket)
    assert {served, *(k for k, _ in blobs)} <= keys
    assert unused not in keys and not {k for k, _ in unused_blobs} & keys
    with urllib.request.urlopen(url, timeout=10) as response:
        assert re_pb2.ActionResult.FromString(response.read()).output_files[0].digest == blobs[0][1]
    assert s3_requests(server.http_address).get("copy") == 1  # at most once a day per entry


def _seed(bucket: str) -> dict[str, set[str]]:
    """3,200 objects; returns their keys by what gc must do with them."""
    s = Seeder(bucket)
    groups: dict[str, set[str]] = {name: set() for name in ("kept", "expired_entries", "removed_blobs")}
    for _ in range(200):  # fresh entries: they and their (old) blobs stay
        blobs = [s.blob(40 * DAY) for _ in range(5)]
        groups["kept"] |= {k for k, _ in blobs}
        groups["kept"].add(s.entry([d for _, d in blobs], 1 * DAY))
    for _ in range(100):  # entries unused for 40 days: they go, then their blobs
        blobs = [s.blob(40 * DAY) for _ in range(5)]
        groups["removed_blobs"] |= {k for k, _ in blobs}
        groups["expired_entries"].add(s.entry([d for _, d in blobs], 40 * DAY))
    groups["removed_blobs"] |= {s.blob(2 * DAY)[0] for _ in range(1000)}  # old, unreferenced
    groups["kept"] |= {s.blob(datetime.timedelta(minutes=5))[0] for _ in range(300)}  # in their grace period
    groups["kept"] |= {s.put(f"ac/raw/sha256/{i:064x}", b"ccache entry", 1 * DAY) for i in range(50)}
    groups["expired_entries"] |= {s.put(f"ac/raw/sha256/{i + 50:064x}", b"old entry", 60 * DAY) for i in range(50)}
    return groups


def _gc(endpoint: str, bucket: str, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = cli.main(["gc", "--s3-endpoint", endpoint, "--s3-bucket", bucket, "--s3-region", REGION, "--json", *extra])
    out = capsys.readouterr().out
    return code, json.loads(out) if out else {}


def test_gc_dry_run_then_real_run(s3_endpoint: str, bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    groups = _seed(bucket)
    before = bucket_keys(s3_endpoint, bucket)
    assert len(before) == 3200

    code, plan = _gc(s3_endpoint, bucket, "--max-age", "30d", "--dry-run", capsys=capsys)
    assert code == 0
    assert (plan["expired_entries"], plan["blobs_removed"], plan["deleted"]) == (150, 1500, 0)
    assert set(plan["keys"]) == groups["expired_entries"] | groups["removed_blobs"]
    assert plan["unreferenced_in_grace"] == 300 and plan["referenced_blobs"] == 1000
    assert bucket_keys(s3_endpoint, bucket) == before  # a dry run deletes nothing

    code, plan = _gc(s3_endpoint, bucket, "--max-age", "30d", capsys=capsys)
    assert code == 0 and plan["deleted"] == 1650
    assert bucket_keys(s3_endpoint, bucket) == groups["kept"]


def test_gc_max_size_removes_oldest_unreferenced_first(
    s3_endpoint: str,
    bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    s = Seeder(bucket)
    oldest = {s.blob((10 + i) * DAY)[0] for i in range(10)}
    newer = {s.blob((2 + i / 10) * DAY)[0] for i in range(10)}
    code, plan = _gc(s3_endpoint, bucket, "--max-size", str(64 * 10), capsys=capsys)
    assert code == 0 and plan["blobs_removed"] == 10
    assert bucket_keys(s3_endpoint, bucket) == newer
    assert oldest.isdisjoint(bucket_keys(s3_endpoint, bucket))


def test_gc_interrupted_leaves_every_remaining_entry_complete(
    s3_endpoint: str,
    bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _seed(bucket)
    real_delete = gc.Bucket.delete
    calls: list[int] = []

    def delete_then_die(self: gc.Bucket, keys: list[str]) -> int:
        calls.append(len(keys))
        if len(calls) > 1:
            raise gc.GcError("interrupted")
        return real_delete(self, keys)

    monkeypatch.setattr(gc.Bucket, "delete", delete_then_die)
    code, _ = _gc(s3_endpoint, bucket, "--max-age", "30d", capsys=capsys)
    assert code == 1 and calls[0] == 150  # the entries went first, in one batch
    keys = bucket_keys(s3_endpoint, bucket)
    _assert_complete(s3_endpoint, bucket, keys)


def _assert_complete(endpoint: str, bucket: str, keys: set[str]) -> None:
    s3 = raw_client(endpoint)
    for key in (k for k in keys if k.startswith("ac/ac/")):
        result = re_pb2.ActionResult.FromString(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        for output in result.output_files:
            assert f"cas/sha256/{output.digest.hash}" in keys, key


def _put(base: str, path: str, data: bytes) -> None:
    request = urllib.request.Request(base + path, data=data, method="PUT")
    with urllib.request.urlopen(request, timeout=10):
        pass


def test_build_beside_gc_gets_only_complete_hits(
    s3_endpoint: str,
    bucket: str,
    buildvault_server_factory: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _seed(bucket)
    writer = buildvault_server_factory("writer", extra_args=tier_args(s3_endpoint, bucket))
    base = f"http://{writer.http_address}"
    written: list[str] = []
    stop = threading.Event()

    def build() -> None:
        # Each "action" has a new output and reuses an old unreferenced blob gc may be deleting.
        olds = [k.rsplit("/", 1)[1] for k in sorted(bucket_keys(s3_endpoint, bucket)) if k.startswith("cas/")]
        i = 0
        while not stop.is_set() or i < 20:
            output = os.urandom(100)
            digest = hashlib.sha256(output).hexdigest()
            _put(base, f"/cas/{digest}", output)
            reused = olds[i % len(olds)]
            result = re_pb2.ActionResult(
                output_files=[
                    re_pb2.OutputFile(path="new", digest=re_pb2.Digest(hash=digest, size_bytes=100)),
                    re_pb2.OutputFile(path="old", digest=re_pb2.Digest(hash=reused, size_bytes=64)),
                ]
            )
            action = hashlib.sha256(f"action {i}".encode()).hexdigest()
            try:
                _put(base, f"/ac/{action}", result.SerializeToString())
                written.append(action)
            except urllib.error.HTTPError as e:
                assert e.code == 400  # the reused blob is gone: the server refuses an incomplete result
            i += 1

    thread = threading.Thread(target=build)
    thread.start()
    try:
        code, plan = _gc(s3_endpoint, bucket, "--max-age", "30d", capsys=capsys)
    finally:
        stop.set()
        thread.join(60)
    assert code == 0 and plan["deleted"] > 0
    assert len(written) >= 20
    wait_drained(writer.http_address)
    # A server with an empty disk on the same bucket: every hit it serves is complete.
    reader = buildvault_server_factory("reader", extra_args=tier_args(s3_endpoint, bucket))
    hits = 0
    for action in written:
        try:
            with urllib.request.urlopen(f"http://{reader.http_address}/ac/{action}", timeout=10) as response:
                result = re_pb2.ActionResult.FromString(response.read())
        except urllib.error.HTTPError as e:
            assert e.code == 404
            continue
        hits += 1
        for output in result.output_files:
            with urllib.request.urlopen(f"http://{reader.http_address}/cas/{output.digest.hash}", timeout=10) as blob:
                assert hashlib.sha256(blob.read()).hexdigest() == output.digest.hash
    assert hits > 0


# Keys outside the layout's shards (other digest functions, instances, kinds, no layout) and at their edges.
ODD_KEYS = [
    "a", "ac0", "ac/raw/sha256/" + "1" * 64, "ac/ac/team-a/sha256/" + "2" * 64, "ac/ac/sha256/zz",
    "cas/blake3/" + "3" * 64, "cas/sha256/", "cas/sha256/G" + "0" * 63, "cas/sha256/:", "cas/sha256/9~x",
    "cas/sha256/9\u00ff", "cas/sha256/g", "cas/sha256/a", "cas0", "zzz", "\u00e9/\u00fc", "\U0001f600",
]  # fmt: skip


@pytest.mark.parametrize("prefix", ["", "team/"])
def test_split_listing_sees_every_object_exactly_once(
    s3_endpoint: str, bucket: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from buildvault.admin import bucket as bucket_module
    from buildvault.config import Settings

    monkeypatch.setattr(bucket_module, "PAGE", 7)  # many pages per shard
    s = Seeder(bucket)
    for i in range(400):
        digest = hashlib.sha256(str(i).encode()).hexdigest()
        s.put(f"{prefix}cas/sha256/{digest}", b"b", DAY)
        if i % 4 == 0:
            s.put(f"{prefix}ac/ac/sha256/{digest}", b"e", DAY)
    for key in ODD_KEYS:
        s.put(prefix + key, b"odd", DAY)
    s.put("elsewhere/cas/sha256/" + "4" * 64, b"not under the prefix", DAY)
    every = bucket_keys(s3_endpoint, bucket)  # one plain listing (botocore's paginator)
    settings = Settings(s3_endpoint=s3_endpoint, s3_bucket=bucket, s3_region=REGION, s3_prefix=prefix)
    store = gc.Bucket(settings)
    with ThreadPoolExecutor(8) as pool:
        for under in ("", "ac/"):
            split = [o.key for objects in store.objects_split(under, pool) for o in objects]
            assert len(split) == len(set(split))
            assert set(split) == {k for k in every if k.startswith(prefix + under)}


def test_gc_handles_keys_outside_the_layout(s3_endpoint: str, bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Blobs of another digest function and odd keys are listed (and counted) like any; only
    `cas/` blobs and `ac/` entries are gc's to delete."""
    s = Seeder(bucket)
    blake3 = s.put("cas/blake3/" + "5" * 64, b"old unreferenced", 40 * DAY)
    instance_blobs = [s.blob(40 * DAY) for _ in range(2)]
    instance_entry = s.put(
        "ac/ac/team-a/sha256/" + "6" * 64,
        re_pb2.ActionResult(
            output_files=[re_pb2.OutputFile(path="o", digest=d) for _, d in instance_blobs]
        ).SerializeToString(),
        1 * DAY,
    )
    other = s.put("zzz/not-a-cache-key", b"left alone", 40 * DAY)
    code, plan = _gc(s3_endpoint, bucket, "--max-age", "30d", capsys=capsys)
    assert code == 0 and plan["objects"] == 4 and plan["blobs_removed"] == 1, plan
    assert bucket_keys(s3_endpoint, bucket) == {instance_entry, other, *(k for k, _ in instance_blobs)}
    assert blake3 not in bucket_keys(s3_endpoint, bucket)


def test_gc_bad_bucket_and_bad_input_change_nothing(
    s3_endpoint: str,
    bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    Seeder(bucket).blob(10 * DAY)
    before = bucket_keys(s3_endpoint, bucket)
    code = cli.main(["gc", "--s3-endpoint", s3_endpoint, "--s3-bucket", "no-such-bucket", "--s3-region", REGION])
    assert code == 1 and "--s3-bucket" in capsys.readouterr().err
    code = cli.main(["gc", "--s3-endpoint", "http://127.0.0.1:9", "--s3-bucket", bucket, "--s3-region", REGION])
    assert code == 1 and "--s3-endpoint" in capsys.readouterr().err
    code = cli.main(["gc", "--s3-endpoint", s3_endpoint, "--s3-bucket", bucket, "--max-age", "soon"])
    assert code == 2 and "duration" in capsys.readouterr().err
    code = cli.main(["gc", "--s3-endpoint", s3_endpoint])
    assert code == 2 and "--s3-bucket" in capsys.readouterr().err
    assert bucket_keys(s3_endpoint, bucket) == before


def test_gc_keeps_the_chunks_of_a_kept_blob_and_drops_an_unreferenced_list(
    s3_endpoint: str, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Seeder(bucket)

    def chunked_blob(age: datetime.timedelta) -> tuple[set[str], re_pb2.Digest]:
        """A blob kept as chunks (storage/chunks): its chunks' objects and its list, no whole object."""
        chunks = [s.blob(age) for _ in range(3)]
        whole = b"".join(os.urandom(1) for _ in range(8))
        digest = re_pb2.Digest(hash=hashlib.sha256(whole).hexdigest(), size_bytes=sum(d.size_bytes for _, d in chunks))
        listed = re_pb2.SplitBlobResponse(chunk_digests=[d for _, d in chunks])
        key = s.put(f"ac/chunks/sha256/{digest.hash}", listed.SerializeToString(), age)
        return {key, *(k for k, _ in chunks)}, digest

    kept_keys, kept = chunked_blob(40 * DAY)
    entry = s.entry([kept], 1 * DAY)  # a fresh entry names the chunked blob
    orphan_keys, _ = chunked_blob(40 * DAY)  # nothing names this one
    code, plan = _gc(s3_endpoint, bucket, "--max-age", "30d", capsys=capsys)
    assert code == 0, plan
    keys = bucket_keys(s3_endpoint, bucket)
    assert {entry, *kept_keys} <= keys
    assert not orphan_keys & keys
