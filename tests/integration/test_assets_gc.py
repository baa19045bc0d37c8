"""Asset entries in the bucket tier: `buildvault gc` keeps what they reference (a fetched blob, a
pushed directory's every file through its Tree blob) and removes blobs nothing references."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from typing import Any

import grpc
import pytest
import s3_server
from asset_origin import AssetOrigin
from reapi_client import CLIENT_OPTIONS, batch_update, digest, make_stubs
from s3_server import REGION, bucket_keys, wait_drained

from buildvault import cli
from buildvault.config import Settings
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


pytestmark = pytest.mark.timeout(300)
