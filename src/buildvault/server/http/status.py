"""The status document (`GET /status`, JSON), the same as a small HTML page (`/`, `/status.html`),
and `GET /metrics` (Prometheus text format).

The document carries buildvault's own field names and, for tools written against bazel-remote,
bazel-remote's (`CurrSize`, `MaxSize`, `NumFiles`, `ServerTime`, `GitCommit`).
"""

from __future__ import annotations

import html
import inspect
import json
import logging
import time
from typing import Any

from aiohttp import web

from buildvault.config import format_size
from buildvault.server.history import History
from buildvault.server.http.charts import charts
from buildvault.server.http.handlers import REQUEST_KIND
from buildvault.server.metrics import Metrics
from buildvault.server.services import PinsSource, StatsSource

__all__ = ["StatusPages", "render_html"]

log = logging.getLogger("buildvault.http")


class StatusPages:
    """The /status, /status.html, / and /metrics handlers over one Metrics and a store stats source."""

    def __init__(self, metrics: Metrics, version: str, stats: StatsSource | None = None) -> None:
        self.metrics = metrics
        self.version = version
        self.stats_source = stats
        self.pins: PinsSource | None = None  # golden versions (server/pins.py)
        self.history = History(metrics, self.refresh_storage)

    async def refresh_storage(self) -> None:
        """Update the storage gauges from the store's stats (if there is a source)."""
        if self.stats_source is None:
            return
        try:
            stats = self.stats_source()
            if inspect.isawaitable(stats):
                stats = await stats
        except Exception:  # /status must answer even if a store cannot tell
            log.warning("storage stats failed", exc_info=True)
            return
        self.metrics.set_storage(stats)

    async def status_document(self) -> dict[str, Any]:
        """The /status JSON object: sizes, counts, uptime and AC hit/miss counts by protocol."""
        await self.refresh_storage()
        s = self.metrics.storage
        counts = self.metrics.ac_counts()
        execution = self.metrics.execution_status  # remote execution: its own section, when on
        chunking = self.metrics.chunking_stats  # dedup at rest: its figures, when on
        return {
            **({"execution": execution()} if execution is not None else {}),
            **({"chunking": chunking()} if chunking is not None else {}),
            "version": self.version,
            "uptime_seconds": round(self.metrics.uptime_seconds, 3),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.metrics.started)),
            "current_size_bytes": s.used_bytes,
            "max_size_bytes": s.max_bytes,
            "blob_count": s.blob_count,
            "ac_entries": s.ac_entries,
            "evictions": s.evictions,
            "oldest_item_age_seconds": s.oldest_item_age_seconds,
            "ac_hits": counts["hits"]["total"],
            "ac_misses": counts["misses"]["total"],
            "ac_hits_by_protocol": {k: v for k, v in counts["hits"].items() if k != "total"},
            "ac_misses_by_protocol": {k: v for k, v in counts["misses"].items() if k != "total"},
            # bazel-remote's field names, for tools written against its /status.
            "CurrSize": s.used_bytes,
            "MaxSize": s.max_bytes,
            "NumFiles": s.blob_count,
            "ServerTime": int(time.time()),
            "GitCommit": self.version,
            "pins": self.pins() if self.pins is not None else [],
            "assets": self.metrics.asset_summary(),  # Remote Asset (buildvault.assets)
        }

    async def status_json(self, request: web.Request) -> web.Response:
        request[REQUEST_KIND] = "status"
        return web.json_response(await self.status_document(), dumps=lambda d: json.dumps(d, indent=2) + "\n")

    async def status_html(self, request: web.Request) -> web.Response:
        request[REQUEST_KIND] = "status"
        await self.history.sample(min_gap=1.0)  # the page shows now, not up to one interval ago
        page = render_html(await self.status_document(), charts(list(self.history.samples)))
        return web.Response(text=page, content_type="text/html")

    async def history_json(self, request: web.Request) -> web.Response:
        """`GET /status/history`: the charts' samples, oldest first."""
        request[REQUEST_KIND] = "status"
        await self.history.sample(min_gap=1.0)
        return web.json_response({"interval_seconds": self.history.interval,
                                  "samples": [s.as_dict() for s in self.history.samples]})

    async def metrics_text(self, request: web.Request) -> web.Response:
        request[REQUEST_KIND] = "metrics"
        await self.refresh_storage()
        response = web.Response(body=self.metrics.render())
        response.headers["Content-Type"] = self.metrics.content_type
        return response


def _human_bytes(value: Any) -> str:
    if value is None:
        return "–"
    return format_size(float(value))


def _human_seconds(value: Any) -> str:
    if value is None:
        return "–"
    seconds = int(value)
    days, seconds = divmod(seconds, 86400)
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    parts = [f"{days}d"] if days else []
    parts += [f"{hours}h"] if hours or days else []
    parts += [f"{minutes}m", f"{seconds}s"]
    return " ".join(parts)


def _count(value: Any) -> str:
    return "–" if value is None else f"{value:,}"


def _execution_rows(execution: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The remote-execution section: pools, workers, queued and running jobs with their ages."""
    if execution is None:
        return []
    rows: list[tuple[str, Any]] = [("Execution sandbox", execution["sandbox"])]
    for pool in execution["pools"]:
        summary = f"{pool['workers']} workers, {pool['busy']} busy, {pool['queued']} queued"
        rows.append((f"Pool {pool['pool']}", summary))
    for worker in execution["workers"]:
        doing = f"{worker['action']} for {_human_seconds(worker['running_seconds'])}" if worker["action"] else ""
        rows.append((f"Worker {worker['name']}", f"{worker['state']} {doing}".strip()))
    for job in execution["queued"]:
        rows.append(("Queued", f"{job['action']} ({job['pool']}) for {_human_seconds(job['age_seconds'])}"))
    for job in execution["running"]:
        rows.append(("Running", f"{job['action']} on {job['worker']} for {_human_seconds(job['age_seconds'])}"))
    return rows


def render_html(doc: dict[str, Any], charts_html: str = "") -> str:
    """The status document as a small self-contained HTML page (with the charts' SVG, if given)."""
    hits, misses = doc["ac_hits"], doc["ac_misses"]
    ratio = f"{100.0 * hits / (hits + misses):.1f}%" if hits + misses else "–"
    used, cap = doc["current_size_bytes"], doc["max_size_bytes"]
    fill = f" ({100.0 * used / cap:.1f}%)" if used is not None and cap else ""
    rows = [
        ("Version", doc["version"]),
        ("Uptime", _human_seconds(doc["uptime_seconds"])),
        ("Disk used", _human_bytes(used) + fill),
        ("Disk limit", _human_bytes(cap)),
        ("CAS blobs", _count(doc["blob_count"])),
        ("Action entries", _count(doc["ac_entries"])),
        ("Evictions", _count(doc["evictions"])),
        ("Oldest item", _human_seconds(doc["oldest_item_age_seconds"])),
        ("AC hits", f"{hits:,}"),
        ("AC misses", f"{misses:,}"),
        ("AC hit ratio", ratio),
        ("Pinned versions", ", ".join(f"{p['name']}/{p['label']}" for p in doc.get("pins", [])) or "–"),
    ]
    assets = doc.get("assets")
    if assets is not None:
        asset_ratio = assets["hit_ratio"]
        rows += [
            ("Assets stored", _count(assets["stored"])),
            ("Asset fetches", _count(sum(assets["fetches"].values()))),
            ("Asset hit ratio", f"{100.0 * asset_ratio:.1f}%" if asset_ratio is not None else "–"),
        ]
    chunking = doc.get("chunking")
    if chunking is not None:
        rows += [
            ("Chunked blobs, logical", _human_bytes(chunking["logical_bytes"])),
            ("Chunked blobs, stored", _human_bytes(chunking["stored_bytes"])),
            ("Dedup ratio", f"{chunking['dedup_ratio']:.2f}"),
            ("Waiting to be chunked", _human_bytes(chunking["backlog_bytes"])),
        ]
    rows += _execution_rows(doc.get("execution"))
    body = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>buildvault status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}
table{{border-collapse:collapse}}th,td{{padding:.3em 1em;border-bottom:1px solid #ddd;text-align:left}}
th{{font-weight:600;color:#555}}td{{font-variant-numeric:tabular-nums}}
.charts{{display:flex;flex-wrap:wrap;gap:1em}}.chart{{margin:0;border:1px solid #eee;border-radius:4px}}
footer{{margin-top:1.5em;color:#777;font-size:.9em}}
</style></head>
<body><h1>buildvault</h1>
<section class="charts">
{charts_html}
</section>
<table>
{body}
</table>
<p><a href="/invocations">Invocations</a>: builds, their cache misses and why they missed</p>
<footer><a href="/status">/status</a> (JSON) · <a href="/status/history">/status/history</a> (samples)
· <a href="/metrics">/metrics</a> (Prometheus)</footer>
</body></html>
"""
