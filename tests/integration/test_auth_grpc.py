"""Access control over gRPC: tokens and htpasswd in `authorization` metadata, grants per instance.

A real `buildvault serve` on loopback with a token file (made by `buildvault token add`), an
htpasswd file (made by `htpasswd`) and an access file; grpcio clients send the credentials.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import grpc
import pytest
from auth_setup import action_result, basic, bearer, htpasswd, metric, new_token, write_access
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import wait_for
from reapi_client import CLIENT_OPTIONS, digest, make_stubs, upload_name, write_requests
from server_process import ServerError, ServerProcess

from buildvault.remote_apis import bs_pb2, re_pb2


class Creds:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.tokens = directory / "tokens"
        self.htpasswd = directory / "htpasswd"
        self.access = directory / "access.toml"
        self.ci = new_token(self.tokens, "ci")
        self.reader = new_token(self.tokens, "reader")
        self.team_a = new_token(self.tokens, "team-a")
        htpasswd(self.htpasswd, "alice", "alice-pw", "bcrypt")
        htpasswd(self.htpasswd, "bob", "bob-pw", "apr1")
        write_access(
            self.access,
            [
                ("ci", ["read", "write"], [""]),
                ("reader", ["read"], [""]),
                ("team-a", ["read", "write"], ["team-a/"]),
                ("alice", ["read", "write"], [""]),
                ("bob", ["read"], [""]),
            ],
        )

    def args(self, *extra: str) -> list[str]:
        return [
            "--token-file", str(self.tokens),
            "--htpasswd-file", str(self.htpasswd),
            "--access-file", str(self.access),
            *extra,
        ]  # fmt: skip


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Creds:
    return Creds(tmp_path_factory.mktemp("creds"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, creds):
    with ServerProcess(tmp_path_factory.mktemp("auth") / "data", extra_args=creds.args(), log_level="debug") as process:
        yield process


@pytest.fixture
async def stubs(server):
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        yield make_stubs(channel)


def auth(value: str | None) -> tuple[tuple[str, str], ...]:
    return () if value is None else (("authorization", value),)


async def update(stubs, value: str | None, instance: str = "") -> re_pb2.Digest:
    action, result = action_result(b"built\n")
    await stubs.ac.UpdateActionResult(
        re_pb2.UpdateActionResultRequest(instance_name=instance, action_digest=action, action_result=result),
        metadata=auth(value),
    )
    return action


async def get(stubs, value: str | None, action: re_pb2.Digest, instance: str = "") -> re_pb2.ActionResult:
    return await stubs.ac.GetActionResult(
        re_pb2.GetActionResultRequest(instance_name=instance, action_digest=action), metadata=auth(value)
    )


async def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, (caught.value.code(), caught.value.details())
    return caught.value.details() or ""


async def test_write_token_writes_and_reads(stubs, creds):
    action = await update(stubs, bearer(creds.ci))
    result = await get(stubs, bearer(creds.ci), action)
    assert result.exit_code == 0 and result.stdout_digest.size_bytes == len(b"built\n")
    data = b"ci blob"
    reply = await stubs.cas.BatchUpdateBlobs(
        re_pb2.BatchUpdateBlobsRequest(
            requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=digest(data), data=data)]
        ),
        metadata=auth(bearer(creds.ci)),
    )
    assert reply.responses[0].status.code == 0


async def test_read_token_reads_but_never_writes(stubs, creds):
    action = await update(stubs, bearer(creds.ci))
    assert (await get(stubs, bearer(creds.reader), action)).exit_code == 0
    details = await refused(update(stubs, bearer(creds.reader)), grpc.StatusCode.PERMISSION_DENIED)
    assert "'reader' lacks write on instance ''" in details
    data = b"poison"
    await refused(
        stubs.cas.BatchUpdateBlobs(
            re_pb2.BatchUpdateBlobsRequest(
                requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=digest(data), data=data)]
            ),
            metadata=auth(bearer(creds.reader)),
        ),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    name = upload_name(digest(data))

    async def stream():
        for r in write_requests(name, data):
            yield r

    await refused(
        stubs.bytestream.Write(stream(), metadata=auth(bearer(creds.reader))), grpc.StatusCode.PERMISSION_DENIED
    )
    await refused(
        stubs.bytestream.QueryWriteStatus(
            bs_pb2.QueryWriteStatusRequest(resource_name=name), metadata=auth(bearer(creds.reader))
        ),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    # Nothing was stored: the writer's own view says the blob is missing.
    reply = await stubs.cas.FindMissingBlobs(
        re_pb2.FindMissingBlobsRequest(blob_digests=[digest(data)]), metadata=auth(bearer(creds.ci))
    )
    assert [d.hash for d in reply.missing_blob_digests] == [digest(data).hash]


async def test_no_or_bad_credentials_are_unauthenticated(stubs, creds):
    action = await update(stubs, bearer(creds.ci))
    await refused(get(stubs, None, action), grpc.StatusCode.UNAUTHENTICATED)
    await refused(get(stubs, bearer("not-a-token"), action), grpc.StatusCode.UNAUTHENTICATED)
    await refused(get(stubs, basic("alice", "wrong"), action), grpc.StatusCode.UNAUTHENTICATED)
    await refused(get(stubs, "Digest abc", action), grpc.StatusCode.UNAUTHENTICATED)
    await refused(update(stubs, None), grpc.StatusCode.UNAUTHENTICATED)


async def test_htpasswd_bcrypt_and_apr1_over_grpc_basic(stubs):
    action = await update(stubs, basic("alice", "alice-pw"))  # bcrypt ($2y$), read + write
    assert (await get(stubs, basic("bob", "bob-pw"), action)).exit_code == 0  # apr1, read only
    await refused(update(stubs, basic("bob", "bob-pw")), grpc.StatusCode.PERMISSION_DENIED)


async def test_capabilities_update_enabled_follows_the_callers_write_permission(stubs, creds):
    async def enabled(value: str | None, instance: str = "") -> bool:
        caps = await stubs.capabilities.GetCapabilities(
            re_pb2.GetCapabilitiesRequest(instance_name=instance), metadata=auth(value)
        )
        return caps.cache_capabilities.action_cache_update_capabilities.update_enabled

    assert await enabled(bearer(creds.ci)) is True
    assert await enabled(bearer(creds.reader)) is False
    assert await enabled(bearer(creds.team_a), "team-a/x") is True
    assert await enabled(bearer(creds.team_a), "team-b") is False
    assert await enabled(None) is False  # no credential: answered, read-only
    await refused(enabled(bearer("wrong")), grpc.StatusCode.UNAUTHENTICATED)


async def test_team_grants_are_per_instance(stubs, creds):
    action = await update(stubs, bearer(creds.team_a), "team-a/lib")
    assert (await get(stubs, bearer(creds.team_a), action, "team-a/lib")).exit_code == 0
    details = await refused(update(stubs, bearer(creds.team_a), "team-b"), grpc.StatusCode.PERMISSION_DENIED)
    assert "lacks write on instance 'team-b'" in details
    await refused(update(stubs, bearer(creds.team_a), "team-ab"), grpc.StatusCode.PERMISSION_DENIED)
    await refused(update(stubs, bearer(creds.team_a), ""), grpc.StatusCode.PERMISSION_DENIED)


async def test_health_answers_without_credentials(server):
    async with grpc.aio.insecure_channel(server.grpc_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="build.bazel.remote.execution.v2.ActionCache"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_refusals_are_counted_by_reason_and_logged_with_principal(server, stubs, creds):
    headers = {"Authorization": bearer(creds.reader)}

    def count(reason: str) -> float:
        return metric(
            server.http_address, "buildvault_auth_refusals_total", {"protocol": "grpc", "reason": reason}, headers
        )

    before = {r: count(r) for r in ("missing", "bad_credentials", "unknown_scheme", "denied")}
    action = await update(stubs, bearer(creds.ci))
    await refused(get(stubs, None, action), grpc.StatusCode.UNAUTHENTICATED)
    await refused(get(stubs, bearer("nope"), action), grpc.StatusCode.UNAUTHENTICATED)
    await refused(get(stubs, "Negotiate abc", action), grpc.StatusCode.UNAUTHENTICATED)
    await refused(update(stubs, bearer(creds.reader)), grpc.StatusCode.PERMISSION_DENIED)
    for reason in before:
        assert count(reason) == before[reason] + 1, reason

    def lines() -> list[dict]:
        out = []
        for line in server.output().splitlines():
            if line.startswith("{") and '"logger":"buildvault.request"' in line:
                out.append(json.loads(line))
        return out

    wait_for(
        lambda: any(r.get("principal") == "ci" and r["rpc"] == "UpdateActionResult" for r in lines()),
        10,
        "ci's log line",
    )
    assert any(r.get("principal") == "anonymous" and r.get("refused") == "missing" for r in lines())
    # The reader was authenticated and lacked write: its refusal is logged under its own name.
    assert any(
        r.get("principal") == "reader" and r.get("refused") == "denied" and r["rpc"] == "UpdateActionResult"
        for r in lines()
    )
    assert not any(r.get("principal") == "anonymous" and r.get("refused") == "denied" for r in lines())
    assert all(creds.ci not in json.dumps(r) and creds.reader not in json.dumps(r) for r in lines())


async def test_unauthenticated_reads_open_reads_only(tmp_path, creds):
    with ServerProcess(tmp_path / "data", extra_args=creds.args("--allow-unauthenticated-reads")) as server:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            s = make_stubs(channel)
            action = await update(s, bearer(creds.ci), "team-b")
            # team-a may read team-b (everyone may), never write it; nobody anonymous writes.
            assert (await get(s, bearer(creds.team_a), action, "team-b")).exit_code == 0
            assert (await get(s, None, action, "team-b")).exit_code == 0
            await refused(update(s, bearer(creds.team_a), "team-b"), grpc.StatusCode.PERMISSION_DENIED)
            await refused(update(s, None, "team-b"), grpc.StatusCode.UNAUTHENTICATED)


async def test_sighup_reloads_the_token_file_and_a_bad_file_keeps_the_old(tmp_path):
    tokens = tmp_path / "tokens"
    old = new_token(tokens, "ci")
    with ServerProcess(tmp_path / "data", extra_args=["--token-file", str(tokens)]) as server:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            s = make_stubs(channel)
            await update(s, bearer(old))
            tokens.write_text("")
            fresh = new_token(tokens, "ci2")
            server.process.send_signal(signal.SIGHUP)
            wait_for(lambda: "reloaded access control" in server.output(), 20, "the reload")
            await update(s, bearer(fresh))
            await refused(update(s, bearer(old)), grpc.StatusCode.UNAUTHENTICATED)
            tokens.write_text("ci2 not-a-hash\n")
            server.process.send_signal(signal.SIGHUP)
            wait_for(lambda: "reload failed, keeping the previous settings" in server.output(), 20, "the failed reload")
            assert "token file" in server.output().split("reload failed")[-1].splitlines()[0]
            await update(s, bearer(fresh))


def test_token_add_prints_the_token_alone_on_the_last_line(tmp_path):
    tokens = tmp_path / "t"
    token = new_token(tokens, "ci")
    principal, hashed = tokens.read_text().split()
    import hashlib

    assert principal == "ci" and hashed == hashlib.sha256(token.encode()).hexdigest()
    assert token not in tokens.read_text() and len(token) >= 40
    assert (tokens.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize(
    ("flag", "setting"),
    [("--token-file", "token_file"), ("--htpasswd-file", "htpasswd_file"), ("--access-file", "access_file")],
)
def test_a_missing_auth_file_stops_the_start_naming_the_setting(tmp_path, flag, setting):
    server = ServerProcess(tmp_path / "data", extra_args=[flag, str(tmp_path / "absent")])
    with pytest.raises(ServerError):
        server.start(timeout=30)
    wait_for(lambda: not server.running, 10, "the server to exit")
    assert setting in server.output() and "absent" in server.output()
