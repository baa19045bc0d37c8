"""A secondary server process: the gRPC cache services on the primary's port, over the primary's store.

    python -m buildvault.server.processes.secondary      (started by supervisor.py, never by hand)

The primary writes one JSON line on the secondary's stdin: the settings (the same values the
primary runs with), the bound gRPC address, the store socket, its index and the largest blob
size. The secondary answers `ready` on stdout once it listens. It serves Capabilities, CAS,
ByteStream and ActionCache (no Execution, no HTTP: `--processes` above 1 needs execution off)
with the same access control, TLS files and message limits as the primary's listener, joined to
the port with SO_REUSEPORT, every store call going to the primary (its stack, from storage/build.py: the primary's store
over storage/processes/client.py).

It ends when the primary does: on SIGTERM (grace for in-flight RPCs; a second one cuts it
short), on end of stdin (the primary is gone, whatever killed it) and, as a second line of
defence, by PR_SET_PDEATHSIG. SIGINT is ignored (a terminal's Ctrl-C reaches the whole group;
the primary then stops its secondaries itself). SIGHUP rereads certificates and auth files.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import sys
from typing import Any

from buildvault import logs
from buildvault.actions import ActionCache
from buildvault.assets import build_assets
from buildvault.config import Settings, load_settings
from buildvault.history import recorder_from_settings
from buildvault.server.auth import Auth, AuthStartupError
from buildvault.server.grpc import MAX_MESSAGE_SIZE
from buildvault.server.grpc.bytestream import Uploads
from buildvault.server.grpc.listener import GrpcListener
from buildvault.server.heap_trim import HeapTrimmer, configure_malloc
from buildvault.server.processes.relay import RelayedMetrics
from buildvault.server.services import Services, StartupError
from buildvault.storage.build import Secondary, open_store_stack

READY = "ready"
_PR_SET_PDEATHSIG = 1


def settings_values(settings: Settings) -> dict[str, Any]:
    """Settings as JSON values every field's parser accepts back."""
    values: dict[str, Any] = {}
    for f in Settings.fields():
        value = getattr(settings, f.name)
        values[f.name] = str(value) if isinstance(value, os.PathLike) else value
    return values


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the primary died before the line above took effect
        sys.exit(0)


async def serve(settings: Settings, config: dict[str, Any]) -> int:
    loop = asyncio.get_running_loop()
    role = Secondary(config["store"], int(config["index"]), int(config["max_blob_size"]))
    stack = await open_store_stack(settings, None, secondary=role)  # the primary meters every call
    assert stack.remote is not None
    metrics = RelayedMetrics(stack.remote, version=str(config.get("version", "")))
    try:
        auth = Auth.from_settings(settings, metrics)
    except AuthStartupError as e:
        print(f"buildvault secondary {config['index']}: {e}", file=sys.stderr)
        return 1
    blobs, actions = stack.blobs, stack.actions
    services = Services(
        blobs=blobs,
        actions=actions,
        action_cache=ActionCache(blobs, actions, message_limit=MAX_MESSAGE_SIZE, recorder=metrics),
        uploads=Uploads(blobs),
        metrics=metrics,
        version=str(config.get("version", "")),
        max_cas_blob_size=stack.max_blob_size,
        auth=auth,
        history=recorder_from_settings(settings, primary=False),
        assets=build_assets(settings, blobs, actions, metrics, primary=False),
    )
    if services.history is not None:
        await services.history.start()
    listener = GrpcListener(config["address"], services, reuseport=True)
    stop = asyncio.Event()
    hurry = asyncio.Event()

    def on_term() -> None:
        (hurry if stop.is_set() else stop).set()

    def on_stdin() -> None:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:  # the primary is gone
            loop.remove_reader(0)
            stop.set()
            hurry.set()

    reloads: set[asyncio.Task[Any]] = set()

    def on_reload() -> None:
        task = asyncio.ensure_future(auth.reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGHUP, on_reload)
    loop.add_reader(0, on_stdin)
    try:
        await listener.start()
    except StartupError as e:
        print(f"buildvault secondary {config['index']}: {e}", file=sys.stderr)
        return 1
    metrics.start()
    heap_trimmer = HeapTrimmer()
    heap_trimmer.start()
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    os.dup2(2, 1)  # nobody reads the pipe after `ready`: anything printed later goes to the log
    await stop.wait()
    stopping = asyncio.ensure_future(listener.stop(float(config.get("grace", 20.0))))
    hurried = asyncio.ensure_future(hurry.wait())
    await asyncio.wait({stopping, hurried}, return_when=asyncio.FIRST_COMPLETED)
    if not stopping.done():
        await listener.stop(0)
        await stopping
    hurried.cancel()
    await heap_trimmer.stop()
    await services.uploads.close()
    await auth.close()
    if services.history is not None:
        await services.history.close()
    await metrics.aclose()
    await stack.aclose()
    return 0


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    config = json.loads(line)
    _die_with_parent(int(config["parent"]))
    settings = load_settings(config["settings"], env={})
    logs.configure(settings.log_level, fmt=settings.log_format)
    configure_malloc()  # before any server thread exists
    return asyncio.run(serve(settings, config))


if __name__ == "__main__":
    sys.exit(main())
