"""The server package's dependency direction: listeners depend on services.py, never on the App."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    ["buildvault.server.http", "buildvault.server.http.listener", "buildvault.server.grpc.listener"],
)
def test_listeners_import_without_the_app(module):
    # A fresh interpreter: what importing the listener pulls in, and nothing the test run loaded.
    code = f"import sys, {module}; print('buildvault.server.app' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr


async def test_both_listeners_report_a_busy_address_as_the_startup_error_the_cli_catches():
    from buildvault.actions import ActionCache
    from buildvault.server.app import StartupError  # what `buildvault serve` catches
    from buildvault.server.grpc.bytestream import Uploads
    from buildvault.server.grpc.listener import GrpcListener
    from buildvault.server.http.listener import HttpListener
    from buildvault.server.metrics import Metrics
    from buildvault.server.services import Services
    from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore

    blobs, actions = MemoryBlobStore(), MemoryActionStore()
    services = Services(blobs, actions, ActionCache(blobs, actions), Uploads(blobs), Metrics(version="t"), "t")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        for listener in (GrpcListener(address, services), HttpListener.from_services(address, services)):
            with pytest.raises(StartupError, match="cannot listen on"):
                await listener.start()
            assert listener.address is None
            await listener.stop(0)
