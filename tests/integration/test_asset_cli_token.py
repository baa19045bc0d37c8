"""`buildvault asset push|fetch` send the token the other clients send (client/remote.py's
TokenSource: BUILDVAULT_TOKEN, or BUILDVAULT_TOKEN_FILE), to a server with token auth."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from auth_setup import new_token, write_access
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)


def asset(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "buildvault.cli", "asset", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_asset_cli_sends_the_token_from_the_environment_or_the_token_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    writer = new_token(tokens, "ci")
    access = write_access(tmp_path / "access.toml", [("ci", ["read", "write"], [""])])
    data = os.urandom(5000)
    (tmp_path / "dep.tgz").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    args = ["--token-file", str(tokens), "--access-file", str(access)]
    with ServerProcess(tmp_path / "data", extra_args=args) as server:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("BUILDVAULT_")}
        env = {**clean, "BUILDVAULT_REMOTE": f"grpc://{server.grpc_address}"}
        push = ["push", str(tmp_path / "dep.tgz"), "--uri", "urn:x:dep"]
        refused = asset(env, *push)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
        token_file = tmp_path / "token"
        token_file.write_text(writer + "\n")
        pushed = asset({**env, "BUILDVAULT_TOKEN_FILE": str(token_file)}, *push)
        assert pushed.returncode == 0, pushed.stderr
        out = tmp_path / "out"
        fetched = asset({**env, "BUILDVAULT_TOKEN": writer}, "fetch", "urn:x:dep", "--sha256", sha, "-o", str(out))
        assert fetched.returncode == 0, fetched.stderr
        assert out.read_bytes() == data
