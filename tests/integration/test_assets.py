"""Remote Asset Fetch and Push against an in-process server (disk store) and a real HTTP origin
on loopback (asset_origin.py): downloads, hits, checksums, SSRF rules, bounds, hostile input."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from asset_origin import AssetOrigin
from google.protobuf import duration_pb2, timestamp_pb2
from google.rpc import error_details_pb2
from reapi_client import CLIENT_OPTIONS, batch_update, digest, make_stubs, missing, read, rich_status

from buildvault.config import Settings
from buildvault.remote_apis import ra_grpc, ra_pb2, re_pb2
from buildvault.server.app import App

Q = ra_pb2.Qualifier


def sri(data: bytes, algorithm: str = "sha256") -> str:
    return f"{algorithm}-{base64.b64encode(hashlib.new(algorithm, data).digest()).decode()}"


class Server:
    def __init__(self, app: App, channel: grpc.aio.Channel) -> None:
        self.app = app
        self.stubs = make_stubs(channel)
        self.fetch = ra_grpc.FetchStub(channel)
        self.push = ra_grpc.PushStub(channel)

    def results(self) -> dict[str, int]:
        return dict(self.app.metrics.asset_results)

    async def fetch_blob(
        self, uris: list[str], *qualifiers: tuple[str, str], **fields: Any
    ) -> ra_pb2.FetchBlobResponse:
        request = ra_pb2.FetchBlobRequest(uris=uris, qualifiers=[Q(name=n, value=v) for n, v in qualifiers], **fields)
        return await self.fetch.FetchBlob(
            request, **({"metadata": fields.pop("metadata")} if "metadata" in fields else {})
        )


@asynccontextmanager
async def serve(tmp_path, **settings: Any) -> AsyncIterator[Server]:
    values: dict[str, Any] = {
        "dir": tmp_path / "data",
        "grpc_address": "127.0.0.1:0",
        "http_address": "",
        "local_workers": "0",
        "processes": 1,
    }
    values.update(settings)
    app = App(Settings(**values))
    await app.start()
    try:
        async with grpc.aio.insecure_channel(app.grpc_address, options=CLIENT_OPTIONS) as channel:
            yield Server(app, channel)
    finally:
        await app.stop(grace=1)


@pytest.fixture
def origin():
    with AssetOrigin() as served:
        yield served


async def failure(call, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    return caught.value


async def test_a_fetch_downloads_once_and_then_hits_and_identical_fetches_share_one_download(tmp_path, origin):
    data = random.randbytes(300_000)
    origin.files["/a.tar.gz"] = data
    origin.files["/b.bin"] = random.randbytes(200_000)
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        answer = await server.fetch_blob([origin.url("/a.tar.gz")], ("checksum.sri", sri(data)))
        assert answer.blob_digest == digest(data) and answer.uri == origin.url("/a.tar.gz")
        assert await read(server.stubs, answer.blob_digest) == data
        again = await server.fetch_blob([origin.url("/mirror/a.tar.gz")], ("checksum.sri", sri(data)))
        assert again.blob_digest == digest(data)  # the same checksum at another URL: a hit
        assert origin.count("/a.tar.gz") == 1 and origin.count("/mirror/a.tar.gz") == 0
        other = origin.files["/b.bin"]
        origin.slow["/b.bin"] = 0.0005  # long enough that all 8 calls overlap
        answers = await asyncio.gather(
            *(server.fetch_blob([origin.url("/b.bin")], ("checksum.sri", sri(other))) for _ in range(8))
        )
        assert {a.blob_digest.hash for a in answers} == {digest(other).hash}
        assert origin.count("/b.bin") == 1
        assert server.results()["downloaded"] == 2 and server.results()["hit"] >= 1


async def test_a_writer_fetch_without_checksum_is_indexed_by_uri_and_oldest_content_refetches(tmp_path, origin):
    origin.files["/latest.txt"] = b"version 1"
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        first = await server.fetch_blob([origin.url("/latest.txt")], ("bazel.canonical_id", "v"))
        assert first.blob_digest == digest(b"version 1")
        origin.files["/latest.txt"] = b"version 2"
        cached = await server.fetch_blob([origin.url("/latest.txt")], ("bazel.canonical_id", "v"))
        assert cached.blob_digest == digest(b"version 1") and origin.count("/latest.txt") == 1
        other_id = await server.fetch_blob([origin.url("/latest.txt")], ("bazel.canonical_id", "w"))
        assert other_id.blob_digest == digest(b"version 2")  # the canonical id is part of the name
        future = timestamp_pb2.Timestamp()
        future.GetCurrentTime()
        fresh = await server.fetch_blob(
            [origin.url("/latest.txt")], ("bazel.canonical_id", "v"), oldest_content_accepted=future
        )
        assert fresh.blob_digest == digest(b"version 2") and origin.count("/latest.txt") == 3


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_checksum_mismatch_names_the_checksum_and_stores_nothing(tmp_path, origin, chunked):
    data = random.randbytes(100_000)
    origin.files["/x.tgz"] = data
    if chunked:
        origin.chunked.add("/x.tgz")
    wrong = sri(b"something else")
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        error = await failure(
            server.fetch_blob([origin.url("/x.tgz")], ("checksum.sri", wrong)), grpc.StatusCode.NOT_FOUND
        )
        assert wrong in error.details() and origin.url("/x.tgz") in error.details()
        assert await missing(server.stubs, [digest(data)]) == {(digest(data).hash, len(data))}
        assert server.results() == {"checksum_mismatch": 1}
        # nothing was indexed under the URL either: a writer's fetch without a checksum downloads again
        await server.fetch_blob([origin.url("/x.tgz")])
        assert origin.count("/x.tgz") == 2


async def test_a_spooled_download_of_several_batches_is_stored_whole_and_the_spool_emptied(tmp_path, origin):
    from prometheus_client.parser import text_string_to_metric_families

    from buildvault.assets import SPOOL_DIR
    from buildvault.assets.origin import SPOOL_BATCH

    data = random.randbytes(2 * SPOOL_BATCH + 12_345)  # two whole batches and a part
    origin.files["/big.tgz"] = data
    origin.chunked.add("/big.tgz")  # no Content-Length: through the spool file
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        answer = await server.fetch_blob([origin.url("/big.tgz")], ("checksum.sri", sri(data, "sha512")))
        assert answer.blob_digest == digest(data)
        assert await read(server.stubs, answer.blob_digest) == data
        assert list((tmp_path / "data" / SPOOL_DIR).iterdir()) == []  # the spool file and the lock are gone
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(server.app.metrics.render().decode())
            for sample in family.samples
        }
        assert samples["buildvault_asset_downloaded_bytes_total"] == len(data)


async def test_a_direct_download_of_many_reads_is_stored_whole_and_any_wrong_checksum_stores_nothing(
    tmp_path, origin
):
    from buildvault.assets.origin import READ_BUFFER

    data = random.randbytes(5 * READ_BUFFER + 4321)  # Content-Length and a sha256: straight into the store
    origin.files["/big.bin"] = data
    origin.files["/big-bad.bin"] = data
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        both = f"{sri(data)} {sri(data, 'sha384')}"
        answer = await server.fetch_blob([origin.url("/big.bin")], ("checksum.sri", both))
        assert answer.blob_digest == digest(data)
        assert await read(server.stubs, answer.blob_digest) == data
    async with serve(tmp_path / "second", asset_allow_hosts="127.0.0.1") as server:  # an empty store
        wrong = sri(data[:-1], "sha384")  # the sha256 matches, the sha384 does not
        error = await failure(
            server.fetch_blob([origin.url("/big-bad.bin")], ("checksum.sri", f"{sri(data)} {wrong}")),
            grpc.StatusCode.NOT_FOUND,
        )
        assert wrong in error.details()
        assert await missing(server.stubs, [digest(data)]) == {(digest(data).hash, len(data))}


async def test_a_spooled_download_with_a_sha256_checksum_hashes_it_once(tmp_path, origin, monkeypatch):
    from buildvault.assets import origin as origin_module

    extra: list[object] = []

    def counted(function):
        extra.append(function)
        return real(function)

    real = origin_module.new_hasher
    monkeypatch.setattr(origin_module, "new_hasher", counted)
    data = random.randbytes(300_000)
    origin.files["/nolength.bin"] = data
    origin.chunked.add("/nolength.bin")  # through the spool file
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        answer = await server.fetch_blob([origin.url("/nolength.bin")], ("checksum.sri", sri(data)))
        assert answer.blob_digest == digest(data) and await read(server.stubs, answer.blob_digest) == data
        assert extra == [], "the CAS digest was hashed beside the sha256 checksum, not shared with it"
        origin.files["/other.bin"] = data[:1000]
        origin.chunked.add("/other.bin")
        await server.fetch_blob([origin.url("/other.bin")], ("checksum.sri", sri(data[:1000], "sha384")))
        assert len(extra) == 1  # no sha256 among the checksums: the digest needs its own hasher


async def test_several_sri_values_and_algorithms_are_all_verified(tmp_path, origin):
    data = random.randbytes(50_000)
    origin.files["/s"] = data
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        both = f"{sri(b'other', 'sha384')} {sri(data, 'sha384')} {sri(data, 'sha512')}"
        answer = await server.fetch_blob([origin.url("/s")], ("checksum.sri", both))
        assert answer.blob_digest == digest(data)
        bad512 = f"{sri(data, 'sha384')} {sri(b'x', 'sha512')}"
        origin.files["/t"] = data
        error = await failure(
            server.fetch_blob([origin.url("/t")], ("checksum.sri", bad512)), grpc.StatusCode.NOT_FOUND
        )
        assert sri(b"x", "sha512") in error.details()
        hit = await server.fetch_blob(["https://elsewhere.example/s"], ("checksum.sri", sri(data, "sha512")))
        assert hit.blob_digest == digest(data)  # indexed under every checksum it was verified against


async def test_the_second_uri_is_tried_when_the_first_fails_and_the_answer_names_each(tmp_path, origin):
    origin.files["/good"] = b"good bytes"
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        answer = await server.fetch_blob(
            [origin.url("/missing"), origin.url("/good")], ("checksum.sri", sri(b"good bytes"))
        )
        assert answer.uri == origin.url("/good")
        error = await failure(
            server.fetch_blob([origin.url("/gone1"), origin.url("/gone2")], ("checksum.sri", sri(b"zz"))),
            grpc.StatusCode.NOT_FOUND,
        )
        assert "/gone1: HTTP 404" in error.details() and "/gone2: HTTP 404" in error.details()


SSRF_URLS = [
    "http://127.0.0.1:{port}/f",
    "http://[::1]:{port}/f",
    "http://10.1.2.3:{port}/f",
    "http://169.254.169.254/latest/meta-data/",
    "http://localhost:{port}/f",
    "http://[::ffff:127.0.0.1]:{port}/f",
    "http://0.0.0.0:{port}/f",
]


async def test_private_loopback_and_link_local_origins_are_refused_by_default(tmp_path, origin):
    origin.files["/f"] = b"secret"
    async with serve(tmp_path) as server:
        for template in SSRF_URLS:
            url = template.format(port=origin.port)
            error = await failure(server.fetch_blob([url], ("checksum.sri", sri(b"secret"))), grpc.StatusCode.NOT_FOUND)
            assert "refused" in error.details(), url
        assert origin.count("/f") == 0
        assert server.results() == {"refused": len(SSRF_URLS)}


async def test_a_redirect_from_an_allowed_origin_to_a_private_address_is_refused(tmp_path, origin):
    origin.files["/f"] = b"secret"
    origin.redirects["/to-localhost"] = origin.url("/f", host="localhost")
    origin.redirects["/to-10"] = "http://10.9.9.9/f"
    origin.redirects["/to-metadata"] = "http://169.254.169.254/latest/meta-data/"
    origin.redirects["/ok"] = "/f"  # same host as written: allowed
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        for path in ("/to-localhost", "/to-10", "/to-metadata"):
            error = await failure(
                server.fetch_blob([origin.url(path)], ("checksum.sri", sri(b"secret"))), grpc.StatusCode.NOT_FOUND
            )
            assert "refused" in error.details()
        assert origin.count("/f") == 0
        answer = await server.fetch_blob([origin.url("/ok")], ("checksum.sri", sri(b"secret")))
        assert answer.blob_digest == digest(b"secret") and origin.count("/f") == 1


async def test_too_many_redirects_and_allow_list_and_origins_none(tmp_path, origin):
    for i in range(7):
        origin.redirects[f"/r{i}"] = f"/r{i + 1}"
    origin.files["/r7"] = b"end"
    origin.files["/f"] = b"f"
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        error = await failure(
            server.fetch_blob([origin.url("/r0")], ("checksum.sri", sri(b"end"))), grpc.StatusCode.NOT_FOUND
        )
        assert "more than 5 redirects" in error.details() and origin.count("/r7") == 0
    async with serve(
        tmp_path, asset_origins="allow-list", asset_allow_hosts="localhost", asset_allow_private=True
    ) as server:
        error = await failure(
            server.fetch_blob([origin.url("/f")], ("checksum.sri", sri(b"f"))), grpc.StatusCode.NOT_FOUND
        )
        assert "not in --asset-allow-hosts" in error.details() and origin.count("/f") == 0
        answer = await server.fetch_blob([origin.url("/f", host="localhost")], ("checksum.sri", sri(b"f")))
        assert answer.blob_digest == digest(b"f")
    async with serve(tmp_path, asset_origins="none", asset_allow_private=True) as server:
        error = await failure(
            server.fetch_blob([origin.url("/r7")], ("checksum.sri", sri(b"zzz"))), grpc.StatusCode.NOT_FOUND
        )
        assert "--asset-origins none" in error.details() and origin.count("/r7") == 0
        # ... but it answers from the index the earlier servers filled
        hit = await server.fetch_blob([origin.url("/f")], ("checksum.sri", sri(b"f")))
        assert hit.blob_digest == digest(b"f")


async def test_credentials_go_only_to_their_origin_and_logs_name_hosts_only(tmp_path, origin, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="buildvault.assets")
    caplog.set_level(logging.DEBUG, logger="buildvault.request")  # last: the capture handler's level too
    origin.files["/private.tgz"] = b"private"
    origin.redirects["/moved"] = origin.url("/private.tgz", host="localhost")
    auth = json.dumps({origin.url("/private.tgz"): {"Authorization": "Bearer s3cret"}})
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1,localhost", log_level="debug") as server:
        await server.fetch_blob(
            [origin.url("/private.tgz")],
            ("checksum.sri", sri(b"private")),
            ("bazel.auth_headers", auth),
            ("http_header:X-Token", "t0k"),
        )
        seen = origin.headers_seen["/private.tgz"]
        assert seen["Authorization"] == "Bearer s3cret" and seen["X-Token"] == "t0k"
        await server.fetch_blob(
            [origin.url("/moved")],
            ("checksum.sri", sri(b"private")),
            ("bazel.canonical_id", "x"),
            ("http_header_url:0:X-Token", "t0k"),
        )
        # the checksum hit answered without the origin: now force a download through the redirect
        origin.files["/private2.tgz"] = b"private2"
        origin.redirects["/moved2"] = origin.url("/private2.tgz", host="localhost")
        await server.fetch_blob(
            [origin.url("/moved2")], ("checksum.sri", sri(b"private2")), ("http_header_url:0:X-Token", "t0k")
        )
        assert origin.headers_seen["/moved2"]["X-Token"] == "t0k"
        assert "X-Token" not in origin.headers_seen["/private2.tgz"]  # another origin: dropped
    logged = "\n".join(str(vars(record)) for record in caplog.records)
    assert f"127.0.0.1:{origin.port}" in logged and "FetchBlob" in logged
    for secret in ("s3cret", "t0k", "/private.tgz", "/moved", "Authorization"):
        assert secret not in logged, secret


async def test_a_slow_origin_is_cut_at_the_timeout(tmp_path, origin):
    origin.files["/slow"] = random.randbytes(200_000)
    origin.slow["/slow"] = 0.05  # ~10 s in all
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1", asset_timeout=30.0) as server:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await failure(
            server.fetch_blob(
                [origin.url("/slow")],
                ("checksum.sri", sri(origin.files["/slow"])),
                timeout=duration_pb2.Duration(nanos=500_000_000),
            ),
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        assert loop.time() - started < 5
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1", asset_timeout=0.5) as server:
        await failure(
            server.fetch_blob([origin.url("/slow")], ("checksum.sri", sri(origin.files["/slow"]))),
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        assert await missing(server.stubs, [digest(origin.files["/slow"])])


@pytest.mark.parametrize("how", ["content-length", "chunked", "lying-length"])
async def test_an_oversize_asset_is_cut_and_nothing_is_stored(tmp_path, origin, how):
    data = random.randbytes(300_000)
    origin.files["/big"] = data
    if how == "chunked":
        origin.chunked.add("/big")
    elif how == "lying-length":
        origin.lying_length["/big"] = 1000  # claims a small body, sends more
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1", asset_max_size=100_000) as server:
        error = await failure(
            server.fetch_blob([origin.url("/big")], ("checksum.sri", sri(data))), grpc.StatusCode.NOT_FOUND
        )
        assert origin.url("/big") in error.details()
        assert await missing(server.stubs, [digest(data)])
        assert not list((tmp_path / "data" / "asset-downloads").glob("download-*"))


def _bad_requests() -> list[tuple[str, ra_pb2.FetchBlobRequest | ra_pb2.PushBlobRequest]]:
    rng = random.Random(34)
    good = sri(b"x")
    out: list[tuple[str, Any]] = []
    bad_uris = ["", " ", "no-scheme", "http://a b/", "http://x/\n", "x" * 9000, "://nohost", "\x00"]
    bad_sris = ["", "md5-abc", "sha256-", "sha256-!!!", "sha256-" + "A" * 10, "sha1-" + good[7:], "sha512-" + good[7:]]
    for uri in bad_uris:
        out.append(("fetch", ra_pb2.FetchBlobRequest(uris=[uri], qualifiers=[Q(name="checksum.sri", value=good)])))
    for value in bad_sris:
        out.append(
            (
                "fetch",
                ra_pb2.FetchBlobRequest(uris=["https://e.example/a"], qualifiers=[Q(name="checksum.sri", value=value)]),
            )
        )
    for _ in range(120):
        kind = rng.randrange(7)
        uris = ["https://e.example/" + str(rng.random())]
        qualifiers = [Q(name="checksum.sri", value=good)]
        fields: dict[str, Any] = {}
        if kind == 0:
            qualifiers = [Q(name=f"q{i}", value="v") for i in range(rng.randrange(65, 3000))]
        elif kind == 1:
            uris = [f"https://e.example/{i}" for i in range(rng.randrange(65, 500))]
        elif kind == 2:
            fields["digest_function"] = rng.choice([2, 3, 4, 5, 6, 7, 8, 99, 1000])
        elif kind == 3:
            qualifiers.append(Q(name="checksum.sri", value=good))
        elif kind == 4:
            qualifiers.append(Q(name="http_header:" + rng.choice(["bad name", "x\r\ny", ""]), value="v"))
        elif kind == 5:
            qualifiers.append(
                Q(name="bazel.auth_headers", value=rng.choice(["{", "[]", '{"u": 1}', '{"u": {"a": 2}}']))
            )
        else:
            fields["instance_name"] = rng.choice(["../etc", "a//b", "/abs", "blobs", "x" * 5000])
        out.append(("fetch", ra_pb2.FetchBlobRequest(uris=uris, qualifiers=qualifiers, **fields)))
    for _ in range(80):
        kind = rng.randrange(5)
        fields = {"uris": ["urn:x:" + str(rng.random())], "blob_digest": digest(b"x")}
        if kind == 0:
            fields["uris"] = []
        elif kind == 1:
            fields["blob_digest"] = re_pb2.Digest(hash="zz" * rng.randrange(1, 40), size_bytes=1)
        elif kind == 2:
            fields["blob_digest"] = re_pb2.Digest(hash=digest(b"x").hash, size_bytes=-rng.randrange(1, 99))
        elif kind == 3:
            fields["qualifiers"] = [Q(name="unknown.qualifier", value="v")]
        else:
            fields["digest_function"] = rng.choice([3, 77])
        out.append(("push", ra_pb2.PushBlobRequest(**fields)))
    return out


async def test_hundreds_of_malformed_requests_are_invalid_argument_with_bad_request_details(tmp_path, origin):
    requests = _bad_requests()
    assert len(requests) >= 200
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        for kind, request in requests:
            call = server.fetch.FetchBlob(request) if kind == "fetch" else server.push.PushBlob(request)
            error = await failure(call, grpc.StatusCode.INVALID_ARGUMENT)
            status = rich_status(error)
            if status is not None and status.details:
                bad = error_details_pb2.BadRequest()
                assert status.details[0].Unpack(bad) and bad.field_violations
        unsupported = await failure(
            server.fetch_blob(["https://e.example/a"], ("vcs.commit", "abc")), grpc.StatusCode.INVALID_ARGUMENT
        )
        bad = error_details_pb2.BadRequest()
        status = rich_status(unsupported)
        assert status is not None and status.details[0].Unpack(bad)
        assert [(v.field, v.description) for v in bad.field_violations] == [
            ("qualifiers.name", '"vcs.commit" not supported')
        ]
        assert origin.requests == {}


async def test_push_blob_and_directory_then_fetch_them_and_missing_content_is_failed_precondition(tmp_path):
    async with serve(tmp_path) as server:
        data = b"an internal tarball"
        missing_push = server.push.PushBlob(ra_pb2.PushBlobRequest(uris=["urn:x:tarball"], blob_digest=digest(data)))
        error = await failure(missing_push, grpc.StatusCode.FAILED_PRECONDITION)
        assert digest(data).hash in error.details()
        await batch_update(server.stubs, [data])
        await server.push.PushBlob(
            ra_pb2.PushBlobRequest(uris=["urn:x:tarball", "https://mirror.example/t.tgz"], blob_digest=digest(data))
        )
        answer = await server.fetch_blob(["https://mirror.example/t.tgz"])
        assert answer.blob_digest == digest(data)
        past = timestamp_pb2.Timestamp(seconds=1000)
        await server.push.PushBlob(
            ra_pb2.PushBlobRequest(uris=["urn:x:expired"], blob_digest=digest(data), expire_at=past)
        )
        await failure(server.fetch_blob(["urn:x:expired"]), grpc.StatusCode.NOT_FOUND)
        # a directory: one file in a subdirectory
        file_data = b"int main() {}\n"
        sub = re_pb2.Directory(files=[re_pb2.FileNode(name="main.cc", digest=digest(file_data))])
        root = re_pb2.Directory(directories=[re_pb2.DirectoryNode(name="src", digest=digest(sub.SerializeToString()))])
        root_bytes = root.SerializeToString()
        await batch_update(server.stubs, [root_bytes, sub.SerializeToString()])
        error = await failure(
            server.push.PushDirectory(
                ra_pb2.PushDirectoryRequest(uris=["urn:x:dir"], root_directory_digest=digest(root_bytes))
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert digest(file_data).hash in error.details()
        await batch_update(server.stubs, [file_data])
        await server.push.PushDirectory(
            ra_pb2.PushDirectoryRequest(uris=["urn:x:dir"], root_directory_digest=digest(root_bytes))
        )
        found = await server.fetch.FetchDirectory(ra_pb2.FetchDirectoryRequest(uris=["urn:x:dir"]))
        assert found.root_directory_digest == digest(root_bytes)
        await failure(
            server.fetch.FetchDirectory(ra_pb2.FetchDirectoryRequest(uris=["urn:x:tarball"])), grpc.StatusCode.NOT_FOUND
        )
        await failure(server.fetch_blob(["urn:x:dir"]), grpc.StatusCode.NOT_FOUND)  # a directory is not a blob


async def test_metrics_count_fetches_by_result_and_downloaded_bytes(tmp_path, origin):
    data = random.randbytes(10_000)
    origin.files["/m"] = data
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1") as server:
        await server.fetch_blob([origin.url("/m")], ("checksum.sri", sri(data)))
        await server.fetch_blob([origin.url("/m")], ("checksum.sri", sri(data)))
        await failure(server.fetch_blob([origin.url("/nope")], ("checksum.sri", sri(b"n"))), grpc.StatusCode.NOT_FOUND)
        text = server.app.metrics.render().decode()
        assert 'buildvault_asset_fetches_total{result="downloaded"} 1.0' in text
        assert 'buildvault_asset_fetches_total{result="hit"} 1.0' in text
        assert 'buildvault_asset_fetches_total{result="miss"} 1.0' in text
        assert f"buildvault_asset_downloaded_bytes_total {float(len(data))}" in text
        assert "buildvault_asset_stored_total 1.0" in text


async def test_the_status_page_shows_the_asset_count_and_hit_ratio(tmp_path, origin):
    import aiohttp

    origin.files["/p"] = b"page"
    async with serve(tmp_path, asset_allow_hosts="127.0.0.1", http_address="127.0.0.1:0") as server:
        for _ in range(4):
            await server.fetch_blob([origin.url("/p")], ("checksum.sri", sri(b"page")))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{server.app.http_address}/status") as response:
                doc = await response.json()
            async with session.get(f"http://{server.app.http_address}/status.html") as r:
                page = await r.text()
        assert doc["assets"] == {"stored": 1, "fetches": {"downloaded": 1, "hit": 3}, "hit_ratio": 0.75}
        assert "Asset hit ratio" in page and "75.0%" in page


async def test_readers_download_only_with_a_checksum_and_never_push(tmp_path, origin):
    from auth_setup import bearer, new_token, write_access

    tokens = tmp_path / "tokens"
    writer, reader = new_token(tokens, "ci"), new_token(tokens, "pr")
    access = write_access(tmp_path / "access.toml", [("ci", ["read", "write"], [""]), ("pr", ["read"], [""])])
    data = random.randbytes(20_000)
    origin.files["/pinned.tgz"] = data
    origin.files["/unpinned.tgz"] = b"anything"
    as_reader = (("authorization", bearer(reader)),)
    as_writer = (("authorization", bearer(writer)),)
    async with serve(
        tmp_path, asset_allow_hosts="127.0.0.1", token_file=str(tokens), access_file=str(access)
    ) as server:
        pinned = ra_pb2.FetchBlobRequest(
            uris=[origin.url("/pinned.tgz")], qualifiers=[Q(name="checksum.sri", value=sri(data))]
        )
        answer = await server.fetch.FetchBlob(pinned, metadata=as_reader)
        assert answer.blob_digest == digest(data) and origin.count("/pinned.tgz") == 1
        unpinned = ra_pb2.FetchBlobRequest(uris=[origin.url("/unpinned.tgz")])
        error = await failure(server.fetch.FetchBlob(unpinned, metadata=as_reader), grpc.StatusCode.NOT_FOUND)
        assert "write permission" in error.details() and origin.count("/unpinned.tgz") == 0
        await failure(server.fetch.FetchBlob(pinned), grpc.StatusCode.UNAUTHENTICATED)
        push = ra_pb2.PushBlobRequest(uris=["urn:x:mine"], blob_digest=digest(data))
        await failure(server.push.PushBlob(push, metadata=as_reader), grpc.StatusCode.PERMISSION_DENIED)
        await server.push.PushBlob(push, metadata=as_writer)
        written = await server.fetch.FetchBlob(unpinned, metadata=as_writer)
        assert written.blob_digest == digest(b"anything") and origin.count("/unpinned.tgz") == 1
        # the writer's copy is now in the index: a reader gets it without a download
        again = await server.fetch.FetchBlob(unpinned, metadata=as_reader)
        assert again.blob_digest == digest(b"anything") and origin.count("/unpinned.tgz") == 1


async def test_reader_downloads_never_and_always(tmp_path, origin):
    from auth_setup import bearer, new_token, write_access

    tokens = tmp_path / "tokens"
    reader = new_token(tokens, "pr")
    access = write_access(tmp_path / "access.toml", [("pr", ["read"], [""])])
    origin.files["/f"] = b"f"
    meta = (("authorization", bearer(reader)),)
    common = {"asset_allow_hosts": "127.0.0.1", "token_file": str(tokens), "access_file": str(access)}
    pinned = ra_pb2.FetchBlobRequest(uris=[origin.url("/f")], qualifiers=[Q(name="checksum.sri", value=sri(b"f"))])
    async with serve(tmp_path, asset_reader_downloads="never", **common) as server:
        await failure(server.fetch.FetchBlob(pinned, metadata=meta), grpc.StatusCode.NOT_FOUND)
        assert origin.count("/f") == 0
    async with serve(tmp_path, asset_reader_downloads="always", **common) as server:
        unpinned = ra_pb2.FetchBlobRequest(uris=[origin.url("/f")])
        assert (await server.fetch.FetchBlob(unpinned, metadata=meta)).blob_digest == digest(b"f")
        assert origin.count("/f") == 1


def test_with_several_processes_every_process_serves_fetches(buildvault_server_factory, origin):
    from auth_setup import metric
    from polling import wait_for

    server = buildvault_server_factory(
        extra_args=["--local-workers", "0", "--processes", "2", "--asset-allow-hosts", "127.0.0.1"]
    )
    files = {f"/p{i}": random.randbytes(5000 + i) for i in range(16)}
    origin.files.update(files)

    async def one(path: str, data: bytes) -> bytes:
        # A local subchannel pool each: channels of one target otherwise share one connection.
        options = [*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(server.grpc_address, options=options) as channel:
            request = ra_pb2.FetchBlobRequest(
                uris=[origin.url(path)], qualifiers=[Q(name="checksum.sri", value=sri(data))]
            )
            answer = await ra_grpc.FetchStub(channel).FetchBlob(request)
            return await read(make_stubs(channel), answer.blob_digest)

    async def all_of_them() -> list[bytes]:
        return await asyncio.gather(*(one(path, data) for path, data in files.items()))

    assert asyncio.run(all_of_them()) == list(files.values())
    assert all(origin.count(path) == 1 for path in files)
    wait_for(
        lambda: metric(server.http_address, "buildvault_secondary_requests_total", {"process": "1"}) > 0,
        30,
        "the secondary's relayed requests (some of the 16 connections reached it)",
    )


def test_with_several_processes_identical_concurrent_fetches_download_once(buildvault_server_factory, origin):
    from auth_setup import metric
    from polling import wait_for

    server = buildvault_server_factory(
        extra_args=["--local-workers", "0", "--processes", "2", "--asset-allow-hosts", "127.0.0.1"]
    )
    data = random.randbytes(400_000)
    origin.files["/slow.tgz"] = data
    origin.slow["/slow.tgz"] = 0.005  # 1 KiB each 5 ms: about two seconds, while every call is in
    before = metric(server.http_address, "buildvault_secondary_requests_total", {"process": "1"})
    callers = 12

    async def one() -> re_pb2.Digest:
        # A channel and a local subchannel pool each: a connection each, spread over the processes.
        options = [*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(server.grpc_address, options=options) as channel:
            request = ra_pb2.FetchBlobRequest(
                uris=[origin.url("/slow.tgz")], qualifiers=[Q(name="checksum.sri", value=sri(data))]
            )
            return (await ra_grpc.FetchStub(channel).FetchBlob(request)).blob_digest

    async def all_of_them() -> list[re_pb2.Digest]:
        return await asyncio.gather(*(one() for _ in range(callers)))

    answers = asyncio.run(all_of_them())
    assert answers == [digest(data)] * callers
    assert origin.count("/slow.tgz") == 1
    wait_for(
        lambda: metric(server.http_address, "buildvault_secondary_requests_total", {"process": "1"}) > before,
        30,
        "the secondary's relayed requests (some of the calls reached it)",
    )
    served = metric(server.http_address, "buildvault_secondary_requests_total", {"process": "1"}) - before
    assert served < callers  # and some reached the primary


async def test_health_reports_the_asset_services(tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with serve(tmp_path) as server:
        health = health_pb2_grpc.HealthStub(server.stubs.channel)
        for service in ("build.bazel.remote.asset.v1.Fetch", "build.bazel.remote.asset.v1.Push"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
