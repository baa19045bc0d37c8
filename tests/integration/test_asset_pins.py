"""A golden pin keeps a Remote Asset: `buildvault asset pin` against a real `buildvault serve`
under a tight `--max-size`. Filled far past the cap, the pinned asset's index entries and blob
stay (FetchBlob answers with the origin down, by URL alone and by checksum alone); the unpinned
asset fetched at the same time is evicted. Unpinned, the golden one goes too. Both for an asset
kept whole and for one kept as chunks (2 MiB and up: its chunks and chunk list are kept too)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random

import grpc
import pytest
from asset_origin import AssetOrigin
from polling import wait_for
from reapi_client import CLIENT_OPTIONS, digest, make_stubs, missing, read, write
from server_process import ServerProcess

from buildvault import cli
from buildvault.remote_apis import ra_grpc, ra_pb2

pytestmark = pytest.mark.timeout(300)

Q = ra_pb2.Qualifier
SIZE = 1 << 20  # the fill's blobs


def sri(data: bytes) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(data).digest()).decode()


async def _fetch(address: str, uris: list[str], *checksum: bytes) -> ra_pb2.FetchBlobResponse:
    qualifiers = [Q(name="checksum.sri", value=sri(c)) for c in checksum]
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        return await ra_grpc.FetchStub(channel).FetchBlob(ra_pb2.FetchBlobRequest(uris=uris, qualifiers=qualifiers))


async def _fill(address: str, count: int, seed: int) -> None:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        for _ in range(count):
            data = rng.randbytes(SIZE)
            assert await write(stubs, data) == SIZE


async def _missing(address: str, *blobs: bytes) -> set[tuple[str, int]]:
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        return await missing(make_stubs(channel), [digest(b) for b in blobs])


async def _read(address: str, data: bytes) -> bytes:
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        return await read(make_stubs(channel), digest(data))


def _not_found(address: str, uris: list[str], *checksum: bytes) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        asyncio.run(_fetch(address, uris, *checksum))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()


@pytest.mark.parametrize("size", [SIZE, 3 * SIZE], ids=["whole", "chunked"])
def test_a_pinned_asset_survives_eviction_and_an_unpinned_one_does_not(tmp_path, capsys, size) -> None:
    golden, other = random.randbytes(size), random.randbytes(size)
    server = ServerProcess(
        tmp_path / "data",
        name="tight",
        extra_args=["--max-size", "8MiB", "--eviction-hold", "0", "--local-workers", "0",
                    "--asset-allow-hosts", "127.0.0.1"],  # fmt: skip
    ).start()
    try:
        address = server.grpc_address
        assert address is not None
        remote = ["--remote", f"grpc://{address}"]
        with AssetOrigin() as origin:
            origin.files.update({"/golden.tgz": golden, "/other.tgz": other})
            golden_url, other_url = origin.url("/golden.tgz"), origin.url("/other.tgz")
            pin = ["asset", "pin", golden_url, "--sha256", hashlib.sha256(golden).hexdigest(), "--label", "v1"]
            assert cli.main([*pin, *remote]) == 0  # downloads it, then pins it
            assert asyncio.run(_fetch(address, [other_url], other)).blob_digest == digest(other)
            assert origin.count("/golden.tgz") == 1 and origin.count("/other.tgz") == 1
        # The origin is gone from here on: whatever is answered comes from the server alone.
        capsys.readouterr()
        assert cli.main(["asset", "pins", *remote]) == 0
        assert capsys.readouterr().out == f"v1\t{hashlib.sha256(golden).hexdigest()}/{size}\n"
        assert ("ac", "assets", "v1") in {(p["namespace"], p["name"], p["label"]) for p in server.status()["pins"]}

        asyncio.run(_fill(address, 24, seed=1))  # 24 MiB through an 8 MiB store
        wait_for(lambda: asyncio.run(_missing(address, other)) != set(), 30, "the unpinned asset evicted")
        assert asyncio.run(_missing(address, golden)) == set()
        # Its URL entry (no checksum: only the index can answer) and its checksum entry, anywhere.
        by_url = asyncio.run(_fetch(address, [golden_url]))
        assert by_url.blob_digest == digest(golden) and by_url.uri == golden_url
        elsewhere = asyncio.run(_fetch(address, ["http://127.0.0.1:9/mirror/golden.tgz"], golden))
        assert elsewhere.blob_digest == digest(golden)
        assert asyncio.run(_read(address, golden)) == golden
        _not_found(address, [other_url])
        _not_found(address, [other_url], other)

        # Unpinned, it ages out like any other entry.
        assert cli.main(["asset", "unpin", "v1", *remote]) == 0
        assert cli.main(["asset", "unpin", "v1", *remote]) == 1  # no such pin any more
        asyncio.run(_fill(address, 24, seed=2))
        wait_for(lambda: asyncio.run(_missing(address, golden)) != set(), 30, "the unpinned golden asset evicted")
        _not_found(address, [golden_url])
    finally:
        server.stop()
