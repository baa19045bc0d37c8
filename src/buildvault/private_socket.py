"""A Unix socket path in a fresh directory only this user can enter (mkdtemp makes it 0700).

    path = await private_socket("store.sock")     # /tmp/buildvault-XXXXXXXX/store.sock
    await remove_private_socket(path)              # the socket and its directory

Used for the local workers' way into a TLS-only gRPC listener (execution/runtime.py) and for the
primary's store, served to its secondary processes (storage/processes/store_server.py): whoever can reach
such a socket needs no credentials, so nobody else may.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path


async def private_socket(name: str) -> str:
    directory = await asyncio.to_thread(tempfile.mkdtemp, prefix="buildvault-")
    return str(Path(directory) / name)


async def remove_private_socket(path: str) -> None:
    await asyncio.to_thread(shutil.rmtree, Path(path).parent, True)
