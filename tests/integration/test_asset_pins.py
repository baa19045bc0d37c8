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
from reapi_client import CLIENT_OPTIONS, batch_update, digest, make_stubs, missing, read, write
from server_process import ServerProcess

from buildvault import cli
from buildvault.remote_apis import ra_grpc, ra_pb2, re_pb2

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


# -- directory assets (PushDirectory / FetchDirectory) ----------------------------------------------


def _directory_tree(big: int) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Three levels: ({file path: bytes}, {directory path: Directory blob}); the root is "".
    `src/lib/big.bin` is `big` bytes (from 2 MiB up the store keeps it as chunks), `src/main.cc` a
    file on disk, `README` a record."""
    files = {"README": random.randbytes(100), "src/main.cc": random.randbytes(200 << 10),
             "src/lib/big.bin": random.randbytes(big)}  # fmt: skip

    def node(path: str) -> re_pb2.FileNode:
        return re_pb2.FileNode(name=path.rsplit("/", 1)[-1], digest=digest(files[path]))

    def directory(file: str, sub: str, below: bytes) -> bytes:
        child = re_pb2.DirectoryNode(name=sub, digest=digest(below))
        return re_pb2.Directory(files=[node(file)], directories=[child]).SerializeToString()

    lib = re_pb2.Directory(files=[node("src/lib/big.bin")]).SerializeToString()
    src = directory("src/main.cc", "lib", lib)
    root = directory("README", "src", src)
    return files, {"": root, "src": src, "src/lib": lib}


async def _push_directory(address: str, uri: str, files: dict[str, bytes], directories: dict[str, bytes]) -> None:
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        for data in files.values():
            assert await write(stubs, data) == len(data)
        await batch_update(stubs, directories.values())
        await ra_grpc.PushStub(channel).PushDirectory(
            ra_pb2.PushDirectoryRequest(uris=[uri], root_directory_digest=digest(directories[""]))
        )


async def _fetch_directory_back(address: str, uri: str) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """FetchDirectory of `uri`, then every blob of its tree read back (GetTree agreeing):
    ({file path: bytes}, {directory path: Directory blob})."""
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        answer = await ra_grpc.FetchStub(channel).FetchDirectory(ra_pb2.FetchDirectoryRequest(uris=[uri]))
        listed = [d async for page in stubs.cas.GetTree(re_pb2.GetTreeRequest(root_digest=answer.root_directory_digest))
                  for d in page.directories]  # fmt: skip
        files: dict[str, bytes] = {}
        directories: dict[str, bytes] = {}
        pending = [("", answer.root_directory_digest)]
        while pending:
            path, where = pending.pop()
            directories[path] = await read(stubs, where)
            directory = re_pb2.Directory.FromString(directories[path])
            prefix = f"{path}/" if path else ""
            for f in directory.files:
                files[prefix + f.name] = await read(stubs, f.digest)
            pending.extend((prefix + d.name, d.digest) for d in directory.directories)
        assert sorted(d.SerializeToString() for d in listed) == sorted(directories.values())
        return files, directories


def _fetch_directory_not_found(address: str, uri: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        asyncio.run(_fetch_directory_back(address, uri))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()


def test_a_pinned_directory_survives_eviction_and_an_unpinned_one_does_not(tmp_path, capsys) -> None:
    golden_files, golden_dirs = _directory_tree(3 * SIZE)  # its big file kept as chunks
    other_files, other_dirs = _directory_tree(SIZE)
    golden_blobs = [*golden_files.values(), *golden_dirs.values()]
    other_blobs = [*other_files.values(), *other_dirs.values()]
    tight = ["--max-size", "8MiB", "--eviction-hold", "0", "--local-workers", "0"]
    server = ServerProcess(tmp_path / "data", name="tight", extra_args=tight).start()
    try:
        address = server.grpc_address
        assert address is not None
        remote = ["--remote", f"grpc://{address}"]
        asyncio.run(_push_directory(address, "urn:x:golden", golden_files, golden_dirs))
        asyncio.run(_push_directory(address, "urn:x:other", other_files, other_dirs))
        capsys.readouterr()
        assert cli.main(["asset", "pin", "urn:x:golden", "--directory", "--label", "tree-v1", *remote]) == 0
        root = digest(golden_dirs[""])
        assert f"directory={root.hash}/{root.size_bytes} directories=3 pin=tree-v1" in capsys.readouterr().out
        assert cli.main(["asset", "pins", *remote]) == 0
        assert capsys.readouterr().out == f"tree-v1\t{root.hash}/{root.size_bytes}\tdirectory\n"
        listed = {(p["name"], p["label"]): p for p in server.status()["pins"]}
        assert listed[("assets", "tree-v1")]["blob"] == f"{root.hash}/{root.size_bytes}"
        assert "tree" in listed[("assets", "tree-v1")]

        asyncio.run(_fill(address, 24, seed=3))  # 24 MiB through an 8 MiB store
        wait_for(lambda: len(asyncio.run(_missing(address, *other_blobs))) == len(other_blobs), 30,
                 "the unpinned directory's every blob evicted")  # fmt: skip
        assert asyncio.run(_missing(address, *golden_blobs)) == set()
        assert asyncio.run(_fetch_directory_back(address, "urn:x:golden")) == (golden_files, golden_dirs)
        _fetch_directory_not_found(address, "urn:x:other")

        # Unpinned, it ages out like any other entry.
        assert cli.main(["asset", "unpin", "tree-v1", *remote]) == 0
        capsys.readouterr()
        assert cli.main(["asset", "pins", *remote]) == 0
        assert capsys.readouterr().out == ""
        asyncio.run(_fill(address, 24, seed=4))
        wait_for(lambda: len(asyncio.run(_missing(address, *golden_blobs))) == len(golden_blobs), 30,
                 "the unpinned golden directory's every blob evicted")  # fmt: skip
        _fetch_directory_not_found(address, "urn:x:golden")
    finally:
        server.stop()


def test_pinning_a_directory_the_server_does_not_have_fails_with_the_reason(tmp_path, capsys) -> None:
    with ServerProcess(tmp_path / "data", extra_args=["--local-workers", "0"]).start() as server:
        remote = ["--remote", f"grpc://{server.grpc_address}"]
        capsys.readouterr()
        assert cli.main(["asset", "pin", "urn:x:never-pushed", "--directory", "--label", "v1", *remote]) == 1
        err = capsys.readouterr().err
        assert "NOT_FOUND" in err and "no directory was pushed" in err, err
        assert cli.main(["asset", "pins", *remote]) == 0
        assert capsys.readouterr().out == ""  # nothing was pinned
        for usage in (["--label", "v1"], ["--directory", "--sha256", "0" * 64, "--label", "v1"]):
            with pytest.raises(SystemExit) as caught:
                cli.main(["asset", "pin", "urn:x:never-pushed", *usage, *remote])
            assert caught.value.code == 2
