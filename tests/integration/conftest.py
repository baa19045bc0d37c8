"""Fixtures: a real buildvault server on loopback, and gRPC clients for it.

- `buildvault_server`: a `buildvault serve` subprocess on 127.0.0.1:0 with a fresh data dir;
  has .grpc_address, .http_address, .data_dir, .stop(), .restart(), .output().
- `buildvault_server_factory`: `start(**ServerProcess kwargs)` for tests that need more than one
  server or special flags; every server is stopped at teardown.
- `app_server`: the App in-process (memory or given stores, short upload grace), for tests
  that need to reach inside (e.g. expire an abandoned upload quickly).
- `shared_buildvault_server`: one server per test module.
- `stubs`: a grpc.aio channel and the REAPI + ByteStream stubs for `shared_buildvault_server`.

Import helpers (`make_stubs`, `CLIENT_OPTIONS`, digests, uploads) from `reapi_client` and the
process wrapper from `server_process`: `from conftest import ...` breaks when another test
directory's conftest is loaded in the same run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from reapi_client import CLIENT_OPTIONS, Stubs, make_stubs  # noqa: E402 - re-exported
from server_process import ServerProcess  # noqa: E402


@pytest.fixture
def buildvault_server_factory(tmp_path):
    started: list[ServerProcess] = []

    def start(name: str = "server", **kwargs) -> ServerProcess:
        server = ServerProcess(tmp_path / name / "data", name=name, **kwargs)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        try:
            server.stop()
        finally:
            server.kill()


@pytest.fixture
def buildvault_server(buildvault_server_factory) -> ServerProcess:
    return buildvault_server_factory()


@pytest.fixture(scope="module")
def shared_buildvault_server(tmp_path_factory) -> ServerProcess:
    """One server for a whole test module (tests that do not stop it or depend on its state)."""
    server = ServerProcess(tmp_path_factory.mktemp("shared") / "data", name="shared")
    server.start()
    yield server
    try:
        server.stop()
    finally:
        server.kill()


@pytest.fixture
async def stubs(shared_buildvault_server):
    async with grpc.aio.insecure_channel(shared_buildvault_server.grpc_address, options=CLIENT_OPTIONS) as channel:
        await channel.channel_ready()
        yield make_stubs(channel)


@dataclass
class InProcess:
    app: object
    grpc_address: str
    stubs: Stubs


@pytest.fixture
async def app_server(tmp_path):
    """The App in-process with memory stores and a 0.5 s upload grace period."""
    from buildvault.config import Settings
    from buildvault.server.app import App
    from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore

    settings = Settings(dir=tmp_path / "data", grpc_address="127.0.0.1:0", http_address="")
    app = App(settings, blobs=MemoryBlobStore(), actions=MemoryActionStore(), upload_grace=0.5)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(app.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            yield InProcess(app, app.grpc_address, make_stubs(channel))
    finally:
        await app.stop(grace=1)
