"""Remote execution when the only gRPC listener speaks TLS: the local workers still reach the CAS
(through the server's private Unix socket), with and without required client certificates."""

from __future__ import annotations

import uuid

import grpc
import pytest
from auth_setup import Pki, write_access
from execution_client import ActionSpec, execute, final_response
from reapi_client import make_stubs, read

pytestmark = pytest.mark.timeout(180)


def _channel(server, pki: Pki, client=None) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca_cert.read_bytes(),
        private_key=client.key_pem if client else None,
        certificate_chain=client.cert_pem if client else None,
    )
    return grpc.aio.secure_channel(server.grpc_address, credentials)


async def _run_remotely(channel: grpc.aio.Channel) -> None:
    word = uuid.uuid4().hex
    spec = ActionSpec(["/bin/sh", "-c", f"cat in > out; echo {word} >> out"], inputs={"in": b"input\n"},
                      output_files=["out"])  # fmt: skip
    stubs = make_stubs(channel)
    response = final_response(await execute(channel, await spec.upload(stubs)))
    assert response.status.code == 0 and response.result.exit_code == 0, response
    # The worker fetched the input and uploaded the output through the server's CAS.
    assert await read(stubs, response.result.output_files[0].digest) == f"input\n{word}\n".encode()


async def test_local_workers_reach_a_tls_only_listener(buildvault_server_factory, tmp_path):
    pki = Pki(tmp_path / "pki")
    cert = pki.issue("server", server=True)
    server = buildvault_server_factory(
        "tls", extra_args=["--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key), "--local-workers", "1"]
    )
    async with _channel(server, pki) as channel:
        await _run_remotely(channel)


async def test_local_workers_reach_a_listener_that_requires_client_certificates(buildvault_server_factory, tmp_path):
    pki = Pki(tmp_path / "pki")
    cert = pki.issue("server", server=True)
    client = pki.issue("builder")
    access = write_access(tmp_path / "access.toml", [("cert:builder", ["read", "write", "execute"], [""])])
    server = buildvault_server_factory(
        "mtls",
        extra_args=[
            "--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key),
            "--tls-client-ca-file", str(pki.ca_cert), "--tls-client-auth", "require",
            "--access-file", str(access), "--local-workers", "1",
        ],
    )  # fmt: skip
    async with _channel(server, pki, client) as channel:
        await _run_remotely(channel)
