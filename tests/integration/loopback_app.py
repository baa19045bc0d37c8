"""An App in this process on loopback ports, over memory stores, with a gRPC channel and an HTTP
session to it: `async with loopback_app(tmp_path, token_file=...) as (app, channel, http)`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from reapi_client import CLIENT_OPTIONS

from buildvault.config import Settings
from buildvault.server.app import App
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore

Session = aiohttp.ClientSession


@asynccontextmanager
async def loopback_app(tmp_path: Path, **settings: Any) -> AsyncIterator[tuple[App, grpc.aio.Channel, Session]]:
    """One process (`processes=1`: what it records is flushed where the pages read it), no workers."""
    values: dict[str, Any] = {
        "dir": tmp_path / "data",
        "grpc_address": "127.0.0.1:0",
        "http_address": "127.0.0.1:0",
        "local_workers": "0",
        "processes": 1,
        **settings,
    }
    app = App(Settings(**values), blobs=MemoryBlobStore(), actions=MemoryActionStore())
    await app.start()
    try:
        async with (
            grpc.aio.insecure_channel(app.grpc_address, options=CLIENT_OPTIONS) as channel,
            aiohttp.ClientSession(f"http://{app.http_address}") as http,
        ):
            yield app, channel, http
    finally:
        await app.stop(grace=1)
