"""`buildvault token ci`: the job's identity token from GitHub Actions' request endpoint (a fake on
loopback that checks what GitHub checks) or GitLab's id_tokens variable, written atomically where
the clients read it; and the clients' TokenSource reading the file again when it changes."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest
from oidc_issuer import TestIssuer, b64

from buildvault.client.remote import RemoteError, TokenSource

REQUEST_TOKEN = "github-request-token-123"


class FakeGitHub(http.server.BaseHTTPRequestHandler):
    token = ""
    seen: list[dict] = []

    def do_GET(self) -> None:  # the stdlib's name
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        FakeGitHub.seen.append({"authorization": self.headers.get("Authorization"), "query": query})
        if self.headers.get("Authorization") != f"Bearer {REQUEST_TOKEN}":
            self.send_response(403)
            self.end_headers()
            return
        # The answer's signature part is the audience asked for, so the test sees that it arrived.
        audience = query.get("audience", [""])[0].encode()
        body = json.dumps({"count": 1, "value": self.token + "." + b64(audience)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def github():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeGitHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeGitHub.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/_apis/token?api-version=2.0"
    server.shutdown()
    thread.join(10)


def token_ci(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACTIONS_", "GITHUB_", "GITLAB_", "BUILDVAULT_"))}
    return subprocess.run(
        [sys.executable, "-m", "buildvault.cli", "token", "ci", *args],
        env={**clean, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_github_actions_token_with_the_audience_written_to_the_token_file(tmp_path, github):
    with TestIssuer(kinds=("ec",)) as issuer:
        jwt_token = issuer.mint()
    FakeGitHub.token = jwt_token.rsplit(".", 1)[0]
    out = tmp_path / "ci.token"
    env = {"ACTIONS_ID_TOKEN_REQUEST_URL": github, "ACTIONS_ID_TOKEN_REQUEST_TOKEN": REQUEST_TOKEN}
    done = token_ci({**env, "BUILDVAULT_TOKEN_FILE": str(out)}, "--audience", "buildvault.example/x y")
    assert done.returncode == 0, done.stderr
    assert FakeGitHub.seen[-1]["query"]["audience"] == ["buildvault.example/x y"]
    assert FakeGitHub.seen[-1]["query"]["api-version"] == ["2.0"]
    assert out.read_text() == FakeGitHub.token + "." + b64(b"buildvault.example/x y") + "\n"
    assert (out.stat().st_mode & 0o777) == 0o600
    assert FakeGitHub.token not in done.stdout + done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["ci.token"]  # no temporary file left
    # The request token wrong: GitHub's 403 is reported, the file is left as it was.
    bad = token_ci({**env, "ACTIONS_ID_TOKEN_REQUEST_TOKEN": "wrong"}, "-o", str(out))
    assert bad.returncode == 1 and "HTTP 403" in bad.stderr
    assert out.read_text().startswith(FakeGitHub.token)


def test_gitlab_id_tokens_variable_and_jobs_without_a_token(tmp_path):
    with TestIssuer(kinds=("rsa",)) as issuer:
        token = issuer.mint()
    out = tmp_path / "t"
    done = token_ci({"GITLAB_CI": "true", "BUILDVAULT_ID_TOKEN": token}, "-o", str(out))
    assert done.returncode == 0 and out.read_text() == token + "\n"
    other = token_ci({"GITLAB_CI": "true", "CACHE_TOKEN": token}, "--variable", "CACHE_TOKEN", "-o", "-")
    assert other.returncode == 0 and other.stdout == token + "\n"
    missing = token_ci({"GITLAB_CI": "true"}, "-o", str(out))
    assert missing.returncode == 1 and "id_tokens" in missing.stderr
    no_permission = token_ci({"GITHUB_ACTIONS": "true"}, "-o", str(out))
    assert no_permission.returncode == 1 and "id-token: write" in no_permission.stderr
    nowhere = token_ci({}, "-o", str(out))
    assert nowhere.returncode == 1 and "not in a CI job" in nowhere.stderr
    not_jwt = token_ci({"GITLAB_CI": "true", "BUILDVAULT_ID_TOKEN": "plain"}, "-o", str(out))
    assert not_jwt.returncode == 1 and "did not give a JWT" in not_jwt.stderr
    assert token_ci({"GITLAB_CI": "true", "BUILDVAULT_ID_TOKEN": token}).returncode == 2  # no -o, no env


def test_token_source_reads_the_file_again_when_it_changes(tmp_path: Path):
    from buildvault.client.ci_token import write_token_file

    path = tmp_path / "token"
    write_token_file(str(path), "first.token.a")
    source = TokenSource({"BUILDVAULT_TOKEN_FILE": str(path)})
    assert source.metadata() == (("authorization", "Bearer first.token.a"),)
    generation = source.generation
    assert not source.changed()
    write_token_file(str(path), "second.token.bb")  # renamed over it: another inode
    assert source.changed()
    assert source.metadata() == (("authorization", "Bearer second.token.bb"),)
    assert source.generation == generation + 1
    path.write_text("third.token.ccc\n")  # rewritten in place (size and mtime change)
    assert source.metadata() == (("authorization", "Bearer third.token.ccc"),)
    path.unlink()  # gone for a moment (a non-atomic writer): the last token is kept
    assert source.metadata() == (("authorization", "Bearer third.token.ccc"),)
    assert TokenSource({"BUILDVAULT_TOKEN": "static", "BUILDVAULT_TOKEN_FILE": str(path)}).metadata() == (
        ("authorization", "Bearer static"),
    )
    with pytest.raises(RemoteError, match="BUILDVAULT_TOKEN_FILE"):
        TokenSource({"BUILDVAULT_TOKEN_FILE": str(tmp_path / "absent")})
