"""TLS on both listeners: grpcio TLS clients, client certificates as principals, reload on SIGHUP."""

from __future__ import annotations

import signal
import socket
import ssl
import urllib.error
import urllib.request

import grpc
import pytest
from auth_setup import Pki, action_result, bearer, new_token, write_access
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import wait_for
from reapi_client import make_stubs
from server_process import ServerError, ServerProcess

from buildvault.remote_apis import re_pb2


def tls_args(pki: Pki, server_cert, client_auth: str = "require") -> list[str]:
    return [
        "--tls-cert-file", str(server_cert.cert),
        "--tls-key-file", str(server_cert.key),
        "--tls-client-ca-file", str(pki.ca_cert),
        "--tls-client-auth", client_auth,
    ]  # fmt: skip


def channel(server: ServerProcess, ca: Pki, client=None) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.ca_cert.read_bytes(),
        private_key=client.key_pem if client else None,
        certificate_chain=client.cert_pem if client else None,
    )
    return grpc.aio.secure_channel(server.grpc_address, credentials)


async def update(ch: grpc.aio.Channel, instance: str = "") -> None:
    action, result = action_result(b"tls\n")
    await make_stubs(ch).ac.UpdateActionResult(
        re_pb2.UpdateActionResultRequest(instance_name=instance, action_digest=action, action_result=result), timeout=20
    )


async def update_enabled(ch: grpc.aio.Channel) -> bool:
    caps = await make_stubs(ch).capabilities.GetCapabilities(re_pb2.GetCapabilitiesRequest(), timeout=20)
    return caps.cache_capabilities.action_cache_update_capabilities.update_enabled


async def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code()


@pytest.mark.parametrize("kind", ["rsa", "ec"])
async def test_grpc_require_maps_certificates_to_grants(tmp_path, kind):
    pki = Pki(tmp_path / "pki", kind=kind)
    other = Pki(tmp_path / "other", name="other-ca", kind=kind)
    access = write_access(
        tmp_path / "access.toml", [("cert:builder", ["read", "write"], [""]), ("cert:viewer", ["read"], [""])]
    )
    args = [*tls_args(pki, pki.issue("localhost", server=True)), "--access-file", str(access), "--http-address", ""]
    with ServerProcess(tmp_path / "data", extra_args=args) as server:
        async with channel(server, pki, pki.issue("builder")) as ch:
            await update(ch)
            assert await update_enabled(ch) is True
        async with channel(server, pki, pki.issue("viewer", kind="rsa" if kind == "ec" else "ec")) as ch:
            assert await code_of(update(ch)) == grpc.StatusCode.PERMISSION_DENIED
            assert await update_enabled(ch) is False
        async with channel(server, pki, pki.issue("nobody")) as ch:
            # Health answers every caller the TLS layer lets in, even one without any grant.
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=20)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert await code_of(update(ch)) == grpc.StatusCode.PERMISSION_DENIED
        # Refused at the handshake: no certificate, another CA's, an expired one.
        for client in (None, other.issue("builder"), pki.issue("builder", expired=True)):
            async with channel(server, pki, client) as ch:
                assert await code_of(update(ch)) == grpc.StatusCode.UNAVAILABLE


async def test_grpc_server_tls_with_tokens_and_no_client_certificates(tmp_path):
    pki = Pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    token = new_token(tokens, "ci")
    cert = pki.issue("localhost", server=True)
    args = ["--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key), "--token-file", str(tokens)]
    with ServerProcess(tmp_path / "data", extra_args=args) as server:
        async with channel(server, pki) as ch:
            stubs = make_stubs(ch)
            action, result = action_result(b"x")
            request = re_pb2.UpdateActionResultRequest(action_digest=action, action_result=result)
            await stubs.ac.UpdateActionResult(request, metadata=(("authorization", bearer(token)),), timeout=20)
            assert await code_of(stubs.ac.UpdateActionResult(request, timeout=20)) == grpc.StatusCode.UNAUTHENTICATED
        # A plaintext client cannot talk to the TLS port.
        async with grpc.aio.insecure_channel(server.grpc_address) as plain:
            assert await code_of(update(plain)) == grpc.StatusCode.UNAVAILABLE


def test_optional_client_certificates_on_grpc_are_refused_at_start(tmp_path):
    pki = Pki(tmp_path / "pki")
    server = ServerProcess(tmp_path / "data", extra_args=tls_args(pki, pki.issue("localhost", server=True), "optional"))
    with pytest.raises(ServerError):
        server.start(timeout=30)
    wait_for(lambda: not server.running, 10, "the server to exit")
    assert "grpcio cannot ask for an optional client certificate" in server.output()


@pytest.mark.parametrize("setting", ["tls_cert_file", "tls_key_file", "tls_client_ca_file"])
def test_missing_tls_file_stops_the_start_naming_the_setting(tmp_path, setting):
    pki = Pki(tmp_path / "pki")
    cert = pki.issue("localhost", server=True)
    files = {"tls_cert_file": str(cert.cert), "tls_key_file": str(cert.key), "tls_client_ca_file": str(pki.ca_cert)}
    files[setting] = str(tmp_path / "missing.pem")
    args = [a for name, path in files.items() for a in ("--" + name.replace("_", "-"), path)]
    server = ServerProcess(tmp_path / "data", extra_args=[*args, "--tls-client-auth", "require"])
    with pytest.raises(ServerError):
        server.start(timeout=30)
    wait_for(lambda: not server.running, 10, "the server to exit")
    assert f"{setting} {tmp_path / 'missing.pem'}" in server.output()


def https(server: ServerProcess, path: str, ca: Pki, client=None, authorization: str | None = None):
    context = ssl.create_default_context(cafile=str(ca.ca_cert))
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    headers = {"Authorization": authorization} if authorization else {}
    request = urllib.request.Request(f"https://{server.http_address}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=20, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def served_certificate(address: str) -> bytes:
    """The DER certificate the server presents to a new connection (checked with the ssl module)."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection((host, int(port)), timeout=20) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der(issued) -> bytes:
    return ssl.PEM_cert_to_DER_cert(issued.cert_pem.decode())


def test_https_require_and_healthz_without_a_certificate(tmp_path):
    pki = Pki(tmp_path / "pki")
    access = write_access(tmp_path / "access.toml", [("cert:builder", ["read", "write"], [""])])
    args = [*tls_args(pki, pki.issue("localhost", server=True)), "--access-file", str(access), "--grpc-address", ""]
    with ServerProcess(tmp_path / "data", extra_args=args) as server:
        assert https(server, "/healthz", pki) == (200, b"ok\n")
        assert https(server, "/status", pki)[0] == 401
        assert https(server, "/status", pki, pki.issue("builder"))[0] == 200
        assert https(server, "/status", pki, pki.issue("stranger"))[0] == 403


def test_https_optional_client_certificates(tmp_path):
    pki = Pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    token = new_token(tokens, "ci")
    args = [*tls_args(pki, pki.issue("localhost", server=True), "optional"), "--token-file", str(tokens)]
    with ServerProcess(tmp_path / "data", extra_args=[*args, "--grpc-address", ""]) as server:
        assert https(server, "/status", pki, authorization=bearer(token))[0] == 200
        assert https(server, "/status", pki, pki.issue("anyone"))[0] == 200
        assert https(server, "/status", pki)[0] == 401


async def test_sighup_swaps_the_certificate_on_both_listeners(tmp_path):
    pki = Pki(tmp_path / "pki")
    first = pki.issue("localhost", server=True)
    live_cert, live_key = tmp_path / "server.crt", tmp_path / "server.key"
    live_cert.write_bytes(first.cert_pem)
    live_key.write_bytes(first.key_pem)
    args = ["--tls-cert-file", str(live_cert), "--tls-key-file", str(live_key),
            "--tls-client-ca-file", str(pki.ca_cert), "--tls-client-auth", "require"]  # fmt: skip
    with ServerProcess(tmp_path / "data", extra_args=args) as server:
        assert served_certificate(server.http_address) == der(first)
        client = pki.issue("builder")
        async with channel(server, pki, client) as old_channel:
            await update(old_channel)
            newer = Pki(tmp_path / "pki2", name="newer-ca")
            second = newer.issue("localhost", server=True)
            live_cert.write_bytes(second.cert_pem)
            live_key.write_bytes(second.key_pem)
            server.process.send_signal(signal.SIGHUP)
            wait_for(lambda: "reloaded access control and TLS certificates" in server.output(), 20, "the reload")
            assert served_certificate(server.http_address) == der(second)
            # The open connection keeps working; a new one sees the new certificate.
            await update(old_channel)
            async with channel(server, newer, client) as new_channel:
                await update(new_channel)
            async with channel(server, pki, client) as stale:
                assert await code_of(update(stale)) == grpc.StatusCode.UNAVAILABLE
            # A broken key file keeps the old (second) certificate.
            live_key.write_text("-----BEGIN PRIVATE KEY-----\nbroken\n-----END PRIVATE KEY-----\n")
            server.process.send_signal(signal.SIGHUP)
            wait_for(lambda: "reload failed" in server.output(), 20, "the failed reload")
            assert served_certificate(server.http_address) == der(second)


def test_min_tls_version_13(tmp_path):
    pki = Pki(tmp_path / "pki")
    cert = pki.issue("localhost", server=True)
    args = ["--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key), "--min-tls-version", "1.3"]
    # grpcio cannot set a minimum version: refused at start-up while gRPC has TLS ...
    server = ServerProcess(tmp_path / "data", extra_args=args)
    with pytest.raises(ServerError):
        server.start(timeout=30)
    wait_for(lambda: not server.running, 10, "the server to exit")
    assert "min_tls_version 1.3" in server.output()
    # ... and enforced on HTTP: a TLS 1.2-only client cannot connect, a 1.3 one can.
    with ServerProcess(tmp_path / "data2", extra_args=[*args, "--grpc-address", ""]) as http_only:
        host, _, port = http_only.http_address.rpartition(":")
        for version, works in ((ssl.TLSVersion.TLSv1_2, False), (ssl.TLSVersion.TLSv1_3, True)):
            context = ssl.create_default_context(cafile=str(pki.ca_cert))
            context.minimum_version = context.maximum_version = version
            try:
                with (
                    socket.create_connection((host, int(port)), timeout=20) as raw,
                    context.wrap_socket(raw, server_hostname="localhost") as tls,
                ):
                    assert tls.version() == "TLSv1.3"
                connected = True
            except ssl.SSLError:
                connected = False
            assert connected is works, version
