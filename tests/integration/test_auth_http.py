"""Access control over HTTP: Basic and Bearer, 401 with a challenge, 403 naming what is missing."""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request

import pytest
from auth_setup import basic, bearer, htpasswd, metric, new_token, write_access
from server_process import ServerProcess


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("creds")
    tokens, users, access = d / "tokens", d / "htpasswd", d / "access.toml"
    out = {"ci": new_token(tokens, "ci"), "reader": new_token(tokens, "reader"), "team-a": new_token(tokens, "team-a")}
    htpasswd(users, "alice", "alice-pw", "bcrypt")
    htpasswd(users, "bob", "bob-pw", "apr1")
    write_access(
        access,
        [
            ("ci", ["read", "write"], [""]),
            ("alice", ["read", "write"], [""]),
            ("reader", ["read"], [""]),
            ("bob", ["read"], [""]),
            ("team-a", ["read", "write"], ["team-a"]),
        ],
    )
    out["args"] = ["--token-file", str(tokens), "--htpasswd-file", str(users), "--access-file", str(access)]  # type: ignore[assignment]
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, files):
    with ServerProcess(tmp_path_factory.mktemp("http") / "data", extra_args=files["args"]) as process:
        yield process


def call(server, method: str, path: str, authorization: str | None = None, body: bytes | None = None):
    headers = {"Authorization": authorization} if authorization else {}
    request = urllib.request.Request(f"http://{server.http_address}{path}", data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def cas_path(data: bytes, instance: str = "") -> str:
    prefix = f"/{instance}" if instance else ""
    return f"{prefix}/cas/{hashlib.sha256(data).hexdigest()}"


def test_bearer_and_basic_write_then_read(server, files):
    for credential in (bearer(files["ci"]), basic("alice", "alice-pw")):
        data = credential.encode()[:20] + b" payload"
        assert call(server, "PUT", cas_path(data), credential, data)[0] == 200
        assert call(server, "GET", cas_path(data), credential)[1] == data
        assert call(server, "GET", cas_path(data), basic("bob", "bob-pw"))[1] == data  # apr1 reader


def test_no_credentials_get_401_with_the_basic_challenge(server):
    status, body, headers = call(server, "GET", cas_path(b"x"))
    assert status == 401 and headers["WWW-Authenticate"] == 'Basic realm="buildvault"'
    assert b"unauthenticated" in body
    for bad in (basic("alice", "nope"), bearer("nope"), "Digest x", "Basic !!!", "Bearer"):
        assert call(server, "GET", cas_path(b"x"), bad)[0] == 401, bad


def test_a_reader_gets_403_naming_permission_and_instance_and_nothing_is_stored(server, files):
    data = b"poisoned object"
    status, body, _ = call(server, "PUT", "/inst" + cas_path(data), bearer(files["reader"]), data)
    assert status == 403 and b"'reader' lacks write on instance 'inst'" in body
    assert call(server, "GET", "/inst" + cas_path(data), bearer(files["ci"]))[0] == 404
    ac = "/ac/" + hashlib.sha256(b"action").hexdigest()
    assert call(server, "PUT", ac, basic("bob", "bob-pw"), b"entry")[0] == 403
    assert call(server, "GET", ac, bearer(files["ci"]))[0] == 404


def test_team_grants_over_http(server, files):
    data = b"team a object"
    assert call(server, "PUT", cas_path(data, "team-a/x"), bearer(files["team-a"]), data)[0] == 200
    assert call(server, "PUT", cas_path(data, "team-b"), bearer(files["team-a"]), data)[0] == 403
    assert call(server, "GET", cas_path(data, "team-b"), bearer(files["team-a"]))[0] == 403


def test_healthz_is_open_and_status_metrics_follow_the_read_rule(server, files):
    assert call(server, "GET", "/healthz")[:2] == (200, b"ok\n")
    assert call(server, "GET", "/status")[0] == 401
    assert call(server, "GET", "/metrics")[0] == 401
    assert call(server, "GET", "/status", bearer(files["reader"]))[0] == 200
    assert call(server, "GET", "/metrics", bearer(files["team-a"]))[0] == 200


def test_metrics_can_be_opened_alone(tmp_path, files):
    with ServerProcess(tmp_path / "data", extra_args=[*files["args"], "--metrics-require-auth", "false"]) as server:
        assert call(server, "GET", "/metrics")[0] == 200
        assert call(server, "GET", "/status")[0] == 401


def test_refusals_are_counted_under_their_route(server, files):
    def count(kind: str, code: str) -> float:
        labels = {"protocol": "http", "method": "PUT" if code == "403" else "GET", "kind": kind, "status": code}
        return metric(server.http_address, "buildvault_requests_total", labels, {"Authorization": bearer(files["ci"])})

    ac = "/ac/" + hashlib.sha256(b"route").hexdigest()
    before = {(k, c): count(k, c) for k in ("ac", "cas", "status", "metrics") for c in ("401", "403")}
    assert call(server, "PUT", ac, bearer(files["reader"]), b"entry")[0] == 403
    assert call(server, "PUT", cas_path(b"r"), bearer(files["reader"]), b"r")[0] == 403
    assert call(server, "GET", cas_path(b"r"))[0] == 401
    assert call(server, "GET", "/status")[0] == 401
    assert call(server, "GET", "/metrics", bearer("wrong"))[0] == 401
    after = {key: count(*key) for key in before}
    changed = {key for key in before if after[key] != before[key]}
    assert changed == {("ac", "403"), ("cas", "403"), ("cas", "401"), ("status", "401"), ("metrics", "401")}
    assert all(after[key] == before[key] + 1 for key in changed)


def test_wrong_password_is_counted(server, files):
    def count() -> float:
        return metric(
            server.http_address,
            "buildvault_auth_refusals_total",
            {"protocol": "http", "reason": "bad_credentials"},
            {"Authorization": bearer(files["reader"])},
        )

    before = count()
    assert call(server, "GET", cas_path(b"y"), basic("alice", "wrong"))[0] == 401
    assert count() == before + 1


def test_unauthenticated_reads(tmp_path, files):
    with ServerProcess(tmp_path / "data", extra_args=[*files["args"], "--allow-unauthenticated-reads"]) as server:
        data = b"shared object"
        assert call(server, "PUT", cas_path(data), None, data)[0] == 401
        assert call(server, "PUT", cas_path(data), bearer(files["ci"]), data)[0] == 200
        assert call(server, "GET", cas_path(data))[1] == data
        assert call(server, "GET", "/status")[0] == 200


def test_no_credentials_configured_keeps_the_open_server(tmp_path):
    with ServerProcess(tmp_path / "data") as server:
        data = b"open"
        assert call(server, "PUT", cas_path(data), None, data)[0] == 200
        assert call(server, "GET", "/healthz")[0] == 200


def test_open_server_warns_when_it_binds_beyond_loopback(tmp_path):
    with ServerProcess(tmp_path / "data", grpc_address="0.0.0.0:0", http_address="") as server:
        assert "no credentials configured" in server.output()
    with ServerProcess(tmp_path / "data2") as server:
        assert "no credentials configured" not in server.output()


def test_request_log_lines_carry_the_principal_never_the_secret(tmp_path, files):
    import json

    with ServerProcess(tmp_path / "data", extra_args=files["args"], log_level="debug") as server:
        assert call(server, "GET", cas_path(b"z"), bearer(files["reader"]))[0] == 404
        assert call(server, "GET", cas_path(b"z"), basic("alice", "alice-pw"))[0] == 404
        assert call(server, "GET", cas_path(b"z"), bearer("wrong-token"))[0] == 401
        assert call(server, "PUT", cas_path(b"z"), bearer(files["reader"]), b"z")[0] == 403

        def lines() -> list[dict]:
            return [
                json.loads(line)
                for line in server.output().splitlines()
                if line.startswith("{") and '"logger":"buildvault.request"' in line
            ]

        from polling import wait_for

        wait_for(lambda: len(lines()) >= 4, 10, "four request log lines")
        assert [r.get("principal") for r in lines()[:4]] == ["reader", "alice", "anonymous", "reader"]
        assert lines()[2]["refused"] == "bad_credentials"
        # An authenticated caller refused for lacking a permission is logged under its own name
        # and its route (cas), not as anonymous on `other`.
        assert lines()[3]["refused"] == "denied" and lines()[3]["rpc"] == "HTTP PUT cas"
        text = server.output()
        assert files["reader"] not in text and "alice-pw" not in text and "wrong-token" not in text
