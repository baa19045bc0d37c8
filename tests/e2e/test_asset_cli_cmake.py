"""`buildvault asset fetch|push` and the CMake helper `buildvault_fetch` (bazel_example's tinyfmt
as a release tarball) against a real server and a loopback origin: cold from the origin, warm with
the origin down, a wrong checksum fails with the reason and a non-zero exit."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from asset_origin import AssetOrigin

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "bazel_example"
BUILDVAULT = Path(sys.executable).parent / "buildvault"


def asset(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUILDVAULT), "asset", *args], env=env, capture_output=True, text=True, timeout=120)


def tinyfmt_tarball() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        tar.add(EXAMPLE / "csrc" / "third_party" / "tinyfmt", arcname="tinyfmt-1.0")
    return out.getvalue()


@pytest.fixture
def env(servers) -> dict[str, str]:
    server = servers("s", "--asset-allow-hosts", "127.0.0.1")
    values = dict(os.environ)
    values["BUILDVAULT_REMOTE"] = f"grpc://{server.grpc_address}"
    return values


def test_cli_fetch_cold_warm_mismatch_and_push(tmp_path, env):
    data = os.urandom(150_000)
    sha = hashlib.sha256(data).hexdigest()
    with AssetOrigin() as origin:
        origin.files["/dep-1.0.tar.gz"] = data
        cold = asset("fetch", origin.url("/dep-1.0.tar.gz"), "--sha256", sha, "-o", str(tmp_path / "cold"), env=env)
        assert cold.returncode == 0, cold.stderr
        assert (tmp_path / "cold").read_bytes() == data and origin.count("/dep-1.0.tar.gz") == 1
        wrong = hashlib.sha256(b"not it").hexdigest()
        origin.files["/other.tar.gz"] = b"other"
        bad = asset("fetch", origin.url("/other.tar.gz"), "--sha256", wrong, "-o", str(tmp_path / "bad"), env=env)
        assert bad.returncode == 1 and not (tmp_path / "bad").exists()
        assert "sha256-" + base64.b64encode(bytes.fromhex(wrong)).decode() in bad.stderr, bad.stderr
    # the origin is down now
    warm = asset("fetch", origin.url("/dep-1.0.tar.gz"), "--sha256", sha, "-o", str(tmp_path / "warm"), env=env)
    assert warm.returncode == 0, warm.stderr
    assert (tmp_path / "warm").read_bytes() == data and origin.count("/dep-1.0.tar.gz") == 1
    gone = asset("fetch", origin.url("/never.tar.gz"), "--sha256", wrong, "-o", str(tmp_path / "gone"), env=env)
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr and "/never.tar.gz" in gone.stderr

    internal = tmp_path / "internal.tgz"
    internal.write_bytes(os.urandom(10_000))
    pushed = asset("push", str(internal), "--uri", "https://internal.example/internal.tgz", env=env)
    assert pushed.returncode == 0, pushed.stderr
    internal_sha = hashlib.sha256(internal.read_bytes()).hexdigest()
    assert pushed.stdout.split()[0] == internal_sha
    back = asset("fetch", "https://internal.example/internal.tgz", "--sha256", internal_sha,
                 "-o", str(tmp_path / "back.tgz"), env=env)  # fmt: skip
    assert back.returncode == 0, back.stderr
    assert (tmp_path / "back.tgz").read_bytes() == internal.read_bytes()


def test_cmake_buildvault_fetch_cold_warm_and_mismatch(tmp_path, env):
    if shutil.which("cmake") is None:
        raise AssertionError("cmake is required (scripts/install-system-deps.sh)")
    archive = tinyfmt_tarball()
    sha = hashlib.sha256(archive).hexdigest()
    checkout = tmp_path / "checkout"
    shutil.copytree(EXAMPLE, checkout, ignore=shutil.ignore_patterns("build", "bazel-*", "__pycache__"))
    shutil.rmtree(checkout / "csrc" / "third_party" / "tinyfmt")  # only the fetched copy can build it

    def build(url: str, checksum: str) -> subprocess.CompletedProcess[str]:
        out = tmp_path / "build"
        shutil.rmtree(out, ignore_errors=True)
        configure = subprocess.run(
            ["cmake", "-S", str(checkout), "-B", str(out), f"-DBUILDVAULT_EXECUTABLE={BUILDVAULT}",
             f"-DCSRC_TINYFMT_URL={url}", f"-DCSRC_TINYFMT_SHA256={checksum}"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if configure.returncode != 0:
            return configure
        return subprocess.run(["cmake", "--build", str(out), "--target", "tinyfmt"], env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    with AssetOrigin() as origin:
        origin.files["/tinyfmt-1.0.tar.gz"] = archive
        url = origin.url("/tinyfmt-1.0.tar.gz")
        cold = build(url, sha)
        assert cold.returncode == 0, cold.stdout + cold.stderr
        assert origin.count("/tinyfmt-1.0.tar.gz") == 1
    warm = build(url, sha)  # origin down, fresh build tree
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert list((tmp_path / "build").rglob("libtinyfmt.a"))
    wrong = hashlib.sha256(b"tampered").hexdigest()
    bad = build(url.replace("tinyfmt-1.0", "tinyfmt-1.1"), wrong)
    assert bad.returncode != 0
    assert "buildvault_fetch(tinyfmt_src)" in bad.stderr and "NOT_FOUND" in bad.stderr, bad.stderr
