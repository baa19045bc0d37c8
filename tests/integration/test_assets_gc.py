"""Asset entries in the bucket tier: `buildvault gc` keeps what they reference (a fetched blob, a
pushed directory's every file through its Tree blob) and removes blobs nothing references; a
pinned directory asset (`buildvault asset pin --directory`) outlives `--max-age` with every blob
of its tree, its chunks included, while an unpinned one of the same age goes."""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import json
import random
from typing import Any

import grpc
import pytest
import s3_server
from asset_origin import AssetOrigin
from reapi_client import CLIENT_OPTIONS, batch_update, digest, make_stubs, write
from s3_server import REGION, bucket_keys, raw_client, wait_drained

from buildvault import cli, pins
from buildvault.assets.index import key_digest, uri_key
from buildvault.config import Settings
from buildvault.digest import DigestFunction
from buildvault.remote_apis import ra_grpc, ra_pb2, re_pb2
from buildvault.server.app import App

Q = ra_pb2.Qualifier
aws_env = s3_server.aws_env
s3_endpoint = s3_server.s3_endpoint
bucket = s3_server.bucket


def sri(data: bytes) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(data).digest()).decode()


async def test_gc_keeps_the_blobs_of_asset_entries(tmp_path, s3_endpoint, bucket, capsys) -> None:
    settings = Settings(
        dir=tmp_path / "data", grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", local_workers="0",
        processes=1, asset_allow_hosts="127.0.0.1", s3_endpoint=s3_endpoint, s3_bucket=bucket, s3_region=REGION,
    )  # fmt: skip
    fetched = b"a fetched tarball " * 100
    file_data = b"int main() {}\n"
    sub = re_pb2.Directory(files=[re_pb2.FileNode(name="main.cc", digest=digest(file_data))])
    root = re_pb2.Directory(directories=[re_pb2.DirectoryNode(name="src", digest=digest(sub.SerializeToString()))])
    unreferenced = b"nobody names me"
    app = App(settings)
    await app.start()
    try:
        with AssetOrigin() as origin:
            origin.files["/t.tgz"] = fetched
            async with grpc.aio.insecure_channel(app.grpc_address, options=CLIENT_OPTIONS) as channel:
                stubs = make_stubs(channel)
                await ra_grpc.FetchStub(channel).FetchBlob(
                    ra_pb2.FetchBlobRequest(uris=[origin.url("/t.tgz")],
                                            qualifiers=[Q(name="checksum.sri", value=sri(fetched))])
                )  # fmt: skip
                await batch_update(stubs, [file_data, sub.SerializeToString(), root.SerializeToString(), unreferenced])
                await ra_grpc.PushStub(channel).PushDirectory(
                    ra_pb2.PushDirectoryRequest(
                        uris=["urn:x:tree"], root_directory_digest=digest(root.SerializeToString())
                    )
                )
        assert app.http_address is not None
        await asyncio.to_thread(wait_drained, app.http_address)  # the server's loop keeps running
    finally:
        await app.stop(grace=1)
    keys = bucket_keys(s3_endpoint, bucket)
    assets = [k for k in keys if k.startswith("ac/asset/")]
    assert len(assets) == 3  # the fetch: its checksum and its URL; the push: its URL
    code = cli.main(["gc", "--s3-endpoint", s3_endpoint, "--s3-bucket", bucket, "--s3-region", REGION,
                     "--grace", "0", "--json"])  # fmt: skip
    plan: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["deleted"] >= 1
    left = bucket_keys(s3_endpoint, bucket)
    for data in (fetched, file_data, sub.SerializeToString(), root.SerializeToString()):
        assert f"cas/sha256/{digest(data).hash}" in left
    assert f"cas/sha256/{digest(unreferenced).hash}" not in left
    assert set(assets) <= left


def _directory(tag: bytes, big: int) -> tuple[list[bytes], list[bytes]]:
    """(file blobs, Directory blobs with the root first) of a two-level tree; its one file of `big`
    bytes is kept as chunks from 2 MiB up."""
    files = [tag + random.randbytes(100), random.randbytes(big)]
    sub = re_pb2.Directory(files=[re_pb2.FileNode(name="big.bin", digest=digest(files[1]))]).SerializeToString()
    root = re_pb2.Directory(
        files=[re_pb2.FileNode(name="a.txt", digest=digest(files[0]))],
        directories=[re_pb2.DirectoryNode(name="sub", digest=digest(sub))],
    ).SerializeToString()
    return files, [root, sub]


def _age_everything(bucket: str, age: datetime.timedelta, keys: set[str]) -> None:
    """Set each object's LastModified (what gc reads as its last use) `age` back, in moto's state."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    when = (datetime.datetime.now(datetime.UTC) - age).replace(tzinfo=None)
    for key in keys:
        backend.get_object(bucket, key).last_modified = when


async def test_gc_keeps_a_pinned_directory_asset_and_its_every_blob(tmp_path, s3_endpoint, bucket, capsys) -> None:
    settings = Settings(
        dir=tmp_path / "data", grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", local_workers="0",
        processes=1, s3_endpoint=s3_endpoint, s3_bucket=bucket, s3_region=REGION,
    )  # fmt: skip
    golden_files, golden_dirs = _directory(b"golden", 3 << 20)
    other_files, other_dirs = _directory(b"other", 64 << 10)
    app = App(settings)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(app.grpc_address, options=CLIENT_OPTIONS) as channel:
            stubs = make_stubs(channel)
            for uri, files, dirs in (("urn:x:golden", golden_files, golden_dirs),
                                     ("urn:x:other", other_files, other_dirs)):  # fmt: skip
                for data in files:
                    assert await write(stubs, data) == len(data)
                await batch_update(stubs, dirs)
                await ra_grpc.PushStub(channel).PushDirectory(
                    ra_pb2.PushDirectoryRequest(uris=[uri], root_directory_digest=digest(dirs[0]))
                )
        pin = ["asset", "pin", "urn:x:golden", "--directory", "--label", "golden", "--remote", f"grpc://{app.grpc_address}"]
        assert await asyncio.to_thread(cli.main, pin) == 0
        assert f"directory={digest(golden_dirs[0]).hash}/" in capsys.readouterr().out
        assert app.http_address is not None
        await asyncio.to_thread(wait_drained, app.http_address)  # the server's loop keeps running
    finally:
        await app.stop(grace=1)
    before = bucket_keys(s3_endpoint, bucket)
    assert any(k.startswith("ac/chunks/") for k in before)  # the golden big file is kept as chunks
    other_entry = f"ac/asset/sha256/{key_digest(uri_key('urn:x:other', []), DigestFunction.SHA256).hash}"
    other_tree = re_pb2.ActionResult.FromString(
        raw_client(s3_endpoint).get_object(Bucket=bucket, Key=other_entry)["Body"].read()
    ).output_directories[0].tree_digest
    _age_everything(bucket, datetime.timedelta(days=90), before)

    code = cli.main(["gc", "--s3-endpoint", s3_endpoint, "--s3-bucket", bucket, "--s3-region", REGION,
                     "--max-age", "30d", "--grace", "1h", "--json"])  # fmt: skip
    plan: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["pinned_entries"] == 2, plan  # the pin index and the golden entry
    # Exactly the unpinned directory goes: its entry, its files, Directories and Tree blob; and
    # the pin index's Action and Command blobs, which no entry names (every write of the index
    # uploads them again).
    gone = {other_entry, f"cas/sha256/{other_tree.hash}"}
    gone |= {f"cas/sha256/{digest(b).hash}" for b in [*other_files, *other_dirs]}
    gone |= {f"cas/sha256/{pins.INDEX_DIGEST.hash}", f"cas/sha256/{digest(pins.INDEX_COMMAND_BLOB).hash}"}
    assert gone <= before
    assert bucket_keys(s3_endpoint, bucket) == before - gone
    # Spelled out: every blob FetchDirectory needs; the big file as its chunk list and chunks.
    big = f"ac/chunks/sha256/{digest(golden_files[1]).hash}"
    chunks = re_pb2.SplitBlobResponse.FromString(
        raw_client(s3_endpoint).get_object(Bucket=bucket, Key=big)["Body"].read()
    ).chunk_digests
    assert len(chunks) > 1
    needed = {big} | {f"cas/sha256/{d.hash}" for d in chunks}
    needed |= {f"cas/sha256/{digest(data).hash}" for data in [golden_files[0], *golden_dirs]}
    assert needed <= before - gone


pytestmark = pytest.mark.timeout(300)
