"""`--audit-log`: every entry written (ActionCache over gRPC and HTTP, pins, artifacts, asset
pushes) is one JSON line naming who wrote it, from which job; `buildvault audit` finds it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from auth_setup import bearer, new_token
from oidc_issuer import TestIssuer
from polling import wait_for
from reapi_client import CLIENT_OPTIONS, digest, make_stubs
from server_process import ServerProcess
from test_auth_oidc import MAIN, PR, grpc_update, http, write_grants

from buildvault.pins import INDEX_DIGEST
from buildvault.remote_apis import ra_grpc, ra_pb2, re_pb2

pytestmark = pytest.mark.timeout(300)


def entries(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def audit(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "buildvault.cli", "audit", *args, "--audit-log", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_every_entry_write_is_recorded_with_its_writer_and_found_by_buildvault_audit(tmp_path):
    with TestIssuer(kinds=("ec",)) as issuer:
        tokens = tmp_path / "tokens"
        admin = new_token(tokens, "admin")
        access = write_grants(tmp_path / "access.toml", issuer.url)
        log = tmp_path / "audit.jsonl"
        args = [
            "--token-file", str(tokens), "--access-file", str(access), "--oidc-issuer", issuer.url,
            "--oidc-audience", issuer.audience, "--audit-log", str(log),
        ]  # fmt: skip
        with ServerProcess(tmp_path / "data", extra_args=args) as server:
            async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
                stubs = make_stubs(channel)
                main = issuer.mint(**MAIN, run_id="987654321")
                # gRPC: an ActionResult written by the main-branch job
                action, code = await grpc_update(stubs, main, "csrc")
                assert code == grpc.StatusCode.OK
                # HTTP: an entry written by the same job (ccache or bazel-remote style)
                http_key = hashlib.sha256(b"http entry").hexdigest()
                assert http(server, "PUT", f"/csrc/ac/{http_key}", main, b"ccache entry")[0] == 200
                # a pin index and an artifact entry, by the static admin token
                auth = (("authorization", bearer(admin)),)
                await stubs.ac.UpdateActionResult(
                    re_pb2.UpdateActionResultRequest(
                        action_digest=INDEX_DIGEST.to_proto(re_pb2.Digest), action_result=re_pb2.ActionResult()
                    ),
                    metadata=auth,
                )
                tree = re_pb2.Tree(root=re_pb2.Directory()).SerializeToString()
                await stubs.cas.BatchUpdateBlobs(
                    re_pb2.BatchUpdateBlobsRequest(
                        requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=digest(tree), data=tree)]
                    ),
                    metadata=auth,
                )
                artifact_key = digest(b"artifact key")
                artifact = re_pb2.ActionResult()
                artifact.output_directories.add(path="artifact", tree_digest=digest(tree))
                await stubs.ac.UpdateActionResult(
                    re_pb2.UpdateActionResultRequest(action_digest=artifact_key, action_result=artifact),
                    metadata=auth,
                )
                # an asset push
                blob = b"an internal tarball"
                await stubs.cas.BatchUpdateBlobs(
                    re_pb2.BatchUpdateBlobsRequest(
                        requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=digest(blob), data=blob)]
                    ),
                    metadata=auth,
                )
                await ra_grpc.PushStub(channel).PushBlob(
                    ra_pb2.PushBlobRequest(uris=["urn:x:tarball"], blob_digest=digest(blob)), metadata=auth
                )
                # reads and refused writes are not recorded
                pr = issuer.mint(**PR)
                assert (await grpc_update(stubs, pr))[1] == grpc.StatusCode.PERMISSION_DENIED
                assert http(server, "GET", f"/csrc/ac/{http_key}", main)[0] == 200
                wait_for(lambda: len(entries(log)) >= 5, 20, "five audit lines")
            host = issuer.url.removeprefix("http://")
        written = entries(log)
        assert [e["kind"] for e in written] == ["action_result", "ac_entry", "pin", "artifact", "asset"]
        grpc_entry, http_entry = written[0], written[1]
        principal = f"oidc:{host}:repo:org/vllm-ascend:ref:refs/heads/main"
        for entry in (grpc_entry, http_entry):
            assert entry["principal"] == principal and entry["instance"] == "csrc"
            assert entry["claims"]["repository"] == "org/vllm-ascend" and entry["claims"]["run_id"] == "987654321"
            assert entry["claims"]["ref"] == "refs/heads/main" and entry["client"]
        assert grpc_entry["protocol"] == "grpc" and grpc_entry["digest"] == f"{action.hash}/{action.size_bytes}"
        assert http_entry["protocol"] == "http" and http_entry["digest"] == http_key
        assert written[2]["principal"] == "admin" and "claims" not in written[2]
        assert written[4]["uris"] == ["urn:x:tarball"]
        assert all(main not in json.dumps(e) and admin not in json.dumps(e) for e in written)
        # `buildvault audit` answers who wrote each entry, from which job
        for wanted in (f"{action.hash}/{action.size_bytes}", action.hash, http_key):
            found = audit(log, wanted)
            assert found.returncode == 0, found.stderr
            assert principal in found.stdout and "run_id=987654321" in found.stdout
            assert "repository=org/vllm-ascend" in found.stdout
        assert "grpc" in audit(log, action.hash).stdout and "http" in audit(log, http_key).stdout
        as_json = audit(log, http_key, "--json")
        assert json.loads(as_json.stdout.splitlines()[0])["digest"] == http_key
        nobody = audit(log, hashlib.sha256(b"never written").hexdigest())
        assert nobody.returncode == 3 and "no write" in nobody.stderr


async def test_audit_without_access_control_and_reopen_on_sighup(tmp_path):
    log = tmp_path / "audit.jsonl"
    with ServerProcess(tmp_path / "data", extra_args=["--audit-log", str(log)]) as server:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            stubs = make_stubs(channel)
            action, code = await grpc_update(stubs, None)
            assert code == grpc.StatusCode.OK
            wait_for(lambda: len(entries(log)) == 1, 20, "the first line")
            assert entries(log)[0]["principal"] == "anonymous"
            os.rename(log, tmp_path / "audit.jsonl.1")  # log rotation
            server.process.send_signal(signal.SIGHUP)
            wait_for(lambda: "reloaded access control" in server.output(), 20, "the reload")
            second, _ = await grpc_update(stubs, None)
            wait_for(lambda: len(entries(log)) == 1, 20, "a line in the new file")
            assert entries(log)[0]["digest"].startswith(second.hash)
            assert len(entries(tmp_path / "audit.jsonl.1")) == 1


def test_an_audit_log_that_cannot_be_written_stops_the_start(tmp_path):
    from server_process import ServerError

    server = ServerProcess(tmp_path / "data", extra_args=["--audit-log", str(tmp_path / "absent" / "audit.jsonl")])
    with pytest.raises(ServerError):
        server.start(timeout=30)
    wait_for(lambda: not server.running, 10, "the server to exit")
    assert "audit_log" in server.output()


async def test_an_accepted_execute_is_audited_with_its_caller(tmp_path):
    from execution_client import ActionSpec, execute, final_response

    tokens = tmp_path / "tokens"
    runner = new_token(tokens, "runner")
    access = tmp_path / "access.toml"
    access.write_text('[[grant]]\nprincipal = "runner"\npermissions = ["read", "write", "execute"]\n')
    log = tmp_path / "audit.jsonl"
    args = ["--local-workers", "1", "--token-file", str(tokens), "--access-file", str(access), "--audit-log", str(log)]
    with ServerProcess(tmp_path / "data", extra_args=args) as server:
        metadata = (("authorization", bearer(runner)),)
        async with grpc.aio.insecure_channel(
            server.grpc_address, options=CLIENT_OPTIONS, interceptors=_with(metadata)
        ) as channel:
            spec = ActionSpec(["/bin/sh", "-c", "echo audited"], salt=b"audit-exec")
            action_digest = await spec.upload(make_stubs(channel))
            response = final_response(await execute(channel, action_digest, skip_cache_lookup=True))
            assert response.status.code == 0 and response.result.exit_code == 0
        wait_for(lambda: any(e["kind"] == "execute" for e in entries(log)), 20, "the execute line")
    executed = [e for e in entries(log) if e["kind"] == "execute"]
    assert len(executed) == 1
    assert executed[0]["principal"] == "runner" and executed[0]["skip_cache_lookup"] is True
    assert executed[0]["digest"] == f"{action_digest.hash}/{action_digest.size_bytes}"


def _with(metadata):  # type: ignore[no-untyped-def]
    """Client interceptors adding `metadata` to every unary and server-streaming call."""

    class Unary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
            return await continuation(details._replace(metadata=list(details.metadata or ()) + list(metadata)), request)

    class Stream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
            return await continuation(details._replace(metadata=list(details.metadata or ()) + list(metadata)), request)

    return [Unary(), Stream()]


async def test_processes_share_the_audit_log_line_by_line(tmp_path):
    """`--processes 2`: the primary and the secondary append to one file; every write is one
    whole line (O_APPEND, one write per batch), none lost or torn."""
    import asyncio

    from test_processes import many, served

    log = tmp_path / "audit.jsonl"
    server = ServerProcess(
        tmp_path / "data", extra_args=["--processes", "2", "--local-workers", "0", "--audit-log", str(log)]
    )
    with server:
        async with many(server.grpc_address) as clients:

            async def writes(stubs) -> list[str]:  # type: ignore[no-untyped-def]
                out = []
                for _ in range(15):
                    action, code = await grpc_update(stubs, None)
                    assert code == grpc.StatusCode.OK
                    out.append(f"{action.hash}/{action.size_bytes}")
                return out

            written = [d for part in await asyncio.gather(*(writes(s) for s in clients)) for d in part]
        # Both processes served writes (the secondary's counts reach /metrics a moment later).
        wait_for(lambda: served(server)[0] > 0 and served(server)[1] > 0, 20, "writes in both processes")
    # The server has stopped: both processes wrote their last batch on the way out.
    lines = log.read_text().splitlines()
    assert len(lines) == len(written)
    assert sorted(json.loads(line)["digest"] for line in lines) == sorted(written)


def test_buildvault_audit_finds_the_log_through_the_servers_own_setting(tmp_path):
    log = tmp_path / "audit.jsonl"
    log.write_text(json.dumps({"time": "t", "kind": "action_result", "digest": "ab12/3", "principal": "ci"}) + "\n")
    config = tmp_path / "server.toml"
    config.write_text(f"audit_log = {json.dumps(str(log))}\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BUILDVAULT_")}

    def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "buildvault.cli", "audit", "ab12"]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    for env in ({**clean, "BUILDVAULT_CONFIG": str(config)}, {**clean, "BUILDVAULT_AUDIT_LOG": str(log)}):
        found = run(env)
        assert found.returncode == 0 and "principal=ci" in found.stdout, found.stderr
    missing = run(clean)
    assert missing.returncode == 2 and "no audit log" in missing.stderr
    bad = run({**clean, "BUILDVAULT_MAX_SIZE": "lots"})
    assert bad.returncode == 2 and "max_size" in bad.stderr.lower(), bad.stderr
