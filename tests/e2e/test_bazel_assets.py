"""Real Bazel 4.2.3 with `--experimental_remote_downloader`: its external downloads served by
buildvault's Remote Asset API.

A workspace with an `http_archive` (a tarball with a BUILD file and a cc_library) and an
`http_file`, both on an HTTP origin the test runs on loopback (allowed with
`--asset-allow-hosts 127.0.0.1`), access control on and a write token:
- the first build downloads each file from the origin once;
- the origin stopped, `bazel clean --expunge` and a fresh `--repository_cache`: the build still
  succeeds, served by buildvault alone;
- a second server on the same bucket (another data dir) serves the same build, origin still down;
- a wrong sha256 fails the build naming the checksum, and stores nothing.
"""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile

import pytest
from asset_origin import AssetOrigin
from auth_setup import bearer, metric, new_token, write_access
from s3_server import create_bucket, tier_args

pytestmark = pytest.mark.timeout(1500)

EXT_BUILD = """cc_library(
    name = "ext",
    srcs = ["ext.cc"],
    hdrs = ["ext.h"],
    visibility = ["//visibility:public"],
)
"""
EXT_H = "int ext_answer();\n"
EXT_CC = '#include "ext.h"\nint ext_answer() { return 42; }\n'
MAIN_CC = '#include <cstdio>\n#include "ext.h"\nint main() { std::printf("ext=%d\\n", ext_answer()); }\n'
DATA = b"a pinned data file, fetched once\n"


def tarball() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, text in (("BUILD.bazel", EXT_BUILD), ("ext.h", EXT_H), ("ext.cc", EXT_CC)):
            data = text.encode()
            info = tarfile.TarInfo(f"ext-1.0/{name}")
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def workspace_text(origin: AssetOrigin, archive_sha: str, file_sha: str, file_path: str = "/data.txt") -> str:
    return f"""
load("@bazel_tools//tools/build_defs/repo:http.bzl", "http_archive", "http_file")

http_archive(
    name = "ext",
    urls = ["{origin.url("/ext-1.0.tar.gz")}"],
    sha256 = "{archive_sha}",
    strip_prefix = "ext-1.0",
)

http_file(
    name = "pinned_data",
    urls = ["{origin.url(file_path)}"],
    sha256 = "{file_sha}",
    downloaded_file_path = "data.txt",
)
"""


def add_targets(ws, origin: AssetOrigin, archive_sha: str, file_sha: str, file_path: str = "/data.txt") -> None:
    base = (ws.path / "WORKSPACE").read_text().split("\nload(")[0]
    ws.write_file("WORKSPACE", base + workspace_text(origin, archive_sha, file_sha, file_path))
    ws.write_file("ext_app/main.cc", MAIN_CC)
    ws.write_file(
        "ext_app/BUILD",
        'cc_binary(name = "hello_ext", srcs = ["main.cc"], deps = ["@ext"])\n'
        'genrule(name = "copy", srcs = ["@pinned_data//file"], outs = ["copied.txt"], cmd = "cp $< $@")\n',
    )


def sri(data: bytes) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(data).digest()).decode()


def test_bazel_external_downloads_come_from_buildvault_once_fetched(tmp_path, servers, bazel_workspace_factory, s3):
    archive = tarball()
    tokens = tmp_path / "tokens"
    ci = new_token(tokens, "ci")
    access = write_access(tmp_path / "access.toml", [("ci", ["read", "write"], [""])])
    bucket = create_bucket(s3.endpoint)
    auth_args = ["--token-file", str(tokens), "--access-file", str(access), "--asset-allow-hosts", "127.0.0.1"]
    a = servers("a", *tier_args(s3.endpoint, bucket, *auth_args))
    headers = {"Authorization": bearer(ci)}

    origin = AssetOrigin().start()
    try:
        origin.files["/ext-1.0.tar.gz"] = archive
        origin.files["/data.txt"] = DATA
        ws = bazel_workspace_factory("ws")
        add_targets(ws, origin, hashlib.sha256(archive).hexdigest(), hashlib.sha256(DATA).hexdigest())

        def build(server, repository_cache: str) -> str:
            url = f"grpc://{server.grpc_address}"
            result = ws.build(
                f"--experimental_remote_downloader={url}",
                f"--remote_header=authorization=Bearer {ci}",
                f"--repository_cache={repository_cache}",
                targets=("//ext_app:all",),
                remote_cache=url,
            )
            assert result.ok, result.output + server.output()
            assert ws.run_binary("ext_app/hello_ext").stdout == "ext=42\n"
            copied = ws.path / "bazel-bin" / "ext_app" / "copied.txt"
            assert copied.read_bytes() == DATA
            return result.output

        build(a, str(tmp_path / "repo-cache-1"))
        assert origin.count("/ext-1.0.tar.gz") == 1 and origin.count("/data.txt") == 1
        assert metric(a.http_address, "buildvault_asset_fetches_total", {"result": "downloaded"}, headers) == 2
    finally:
        origin.stop()

    # The origin is gone: a clean workspace with an empty repository cache builds from buildvault.
    ws.clean(expunge=True)
    build(a, str(tmp_path / "repo-cache-2"))
    assert metric(a.http_address, "buildvault_asset_fetches_total", {"result": "hit"}, headers) == 2
    assert origin.count("/ext-1.0.tar.gz") == 1 and origin.count("/data.txt") == 1

    # A second server on the same bucket serves the same build, the origin still down.
    from polling import wait_for

    wait_for(
        lambda: metric(a.http_address, "buildvault_upload_journal_backlog", {}, headers) == 0,
        60,
        "A's journal to drain",
    )
    a.stop()
    b = servers("b", *tier_args(s3.endpoint, bucket, *auth_args))
    ws.clean(expunge=True)
    build(b, str(tmp_path / "repo-cache-3"))
    assert metric(b.http_address, "buildvault_asset_fetches_total", {"result": "hit"}, headers) == 2
    assert metric(b.http_address, "buildvault_asset_fetches_total", {"result": "downloaded"}, headers) == 0


def test_bazel_a_wrong_sha256_fails_naming_the_checksum_and_stores_nothing(tmp_path, servers, bazel_workspace_factory):
    archive = tarball()
    server = servers("s", "--asset-allow-hosts", "127.0.0.1")
    with AssetOrigin() as origin:
        origin.files["/ext-1.0.tar.gz"] = archive
        origin.files["/other.txt"] = b"other content\n"
        wrong = hashlib.sha256(b"what the workspace pins").hexdigest()
        ws = bazel_workspace_factory("ws")
        add_targets(ws, origin, hashlib.sha256(archive).hexdigest(), wrong, "/other.txt")
        url = f"grpc://{server.grpc_address}"
        result = ws.build(f"--experimental_remote_downloader={url}", targets=("//ext_app:all",), remote_cache=url)
        assert not result.ok
        wanted = "sha256-" + base64.b64encode(bytes.fromhex(wrong)).decode()
        assert wanted in result.output, result.output
        assert origin.count("/other.txt") == 1
        assert metric(server.http_address, "buildvault_asset_fetches_total", {"result": "checksum_mismatch"}) == 1
        # nothing stored: the bytes the origin sent are not in the CAS
        import grpc

        from buildvault.remote_apis import re_grpc, re_pb2

        content = b"other content\n"
        with grpc.insecure_channel(server.grpc_address) as channel:
            found = re_grpc.ContentAddressableStorageStub(channel).FindMissingBlobs(
                re_pb2.FindMissingBlobsRequest(
                    blob_digests=[re_pb2.Digest(hash=hashlib.sha256(content).hexdigest(), size_bytes=len(content))]
                )
            )
        assert len(found.missing_blob_digests) == 1
