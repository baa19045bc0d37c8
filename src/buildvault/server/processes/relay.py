"""A secondary server process's metrics: its request observations, relayed to the primary's /metrics.

A secondary serves no /metrics of its own. `RelayedMetrics` is the `Metrics` its gRPC listener
records into; the observations that the primary cannot see (RPC counts and durations, action
cache hits and misses, access-control refusals) are kept as small events and sent to the primary
every `interval` seconds in one METRICS frame (storage/processes/wire.py); the primary's store
server (storage/processes/store_server.py) hands them to `RelayReceiver`, which adds them to the
primary's counters. Both ends of the event format live here. Store-level counts need no relay:
every store call is served, and metered, by the primary.

Not relayed: the per-protocol `cas_read_bytes` / `cas_written_bytes` of RPCs served by a
secondary (the primary's store tier counts those bytes, without a protocol).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from buildvault.server.background import cancel_and_wait
from buildvault.server.metrics import Metrics
from buildvault.storage.processes.client import RemoteStoreClient
from buildvault.storage.processes.wire import Kind

__all__ = ["RelayReceiver", "RelayedMetrics"]

log = logging.getLogger("buildvault.metrics_relay")

MAX_PENDING = 100_000  # events kept while the primary is slow to take them; beyond, dropped


class RelayedMetrics(Metrics):
    def __init__(self, client: RemoteStoreClient, version: str = "", interval: float = 1.0) -> None:
        super().__init__(version=version)
        self.client = client
        self.interval = interval
        self.pending: list[list[Any]] = []
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    def _event(self, event: list[Any]) -> None:
        if len(self.pending) < MAX_PENDING:
            self.pending.append(event)
        else:
            self.dropped += 1

    def observe_request(self, protocol: str, method: str, kind: str, status: str | int, seconds: float) -> None:
        self._event(["request", protocol, method, kind, str(status), round(seconds, 6)])

    def ac_lookup(self, protocol: str, hit: bool) -> None:
        self._event(["ac", protocol, hit])

    def auth_refused(self, protocol: str, reason: str) -> None:
        self._event(["refused", protocol, reason])

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="metrics relay")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)  # a period, not synchronisation
            await self.flush()

    async def flush(self) -> None:
        events, self.pending = self.pending, []
        if not events:
            return
        try:
            await self.client.send(Kind.METRICS, json.dumps(events, separators=(",", ":")).encode())
        except Exception as e:  # the primary is going away: these counts go with it
            log.debug("metrics relay: %s", e)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await self.flush()


class RelayReceiver:
    """The primary's end: what the store server counts, into the primary's `Metrics`."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def ipc_request(self, process: str) -> None:
        self.metrics.ipc_request(process)

    def relayed(self, process: str, events: list[list[Any]]) -> None:
        for event in events:
            apply_relayed(self.metrics, process, event)


def apply_relayed(metrics: Metrics, process: str, event: list[Any]) -> None:
    """One observation secondary `process` made (`RelayedMetrics`), counted by the primary."""
    what = event[0]
    if what == "request":
        _, protocol, method, kind, status, seconds = event
        metrics.observe_request(str(protocol), str(method), str(kind), str(status), float(seconds))
        metrics.secondary_requests.labels(process).inc()
    elif what == "ac":
        metrics.ac_lookup(str(event[1]), bool(event[2]))
    elif what == "refused":
        metrics.auth_refused(str(event[1]), str(event[2]))
    else:
        raise KeyError(what)
