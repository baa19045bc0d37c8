"""`buildvault status [--server URL] [--json]`: size, cap, hit ratio and upload backlog of a
running server, from its `/status` document and `/metrics` (the journal gauges)."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from buildvault.admin.report import emit, human_bytes

BACKLOG_METRIC = "buildvault_upload_journal_backlog"


class StatusError(RuntimeError):
    """The server could not be asked; the message names the URL."""


def _get(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as e:
        raise StatusError(f"--server: {url} answered {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise StatusError(f"--server: {url}: {getattr(e, 'reason', e)}") from None


def upload_backlog(metrics_text: str) -> int | None:
    """The journal backlog gauge, or None when the server has no upload journal (disk only)."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == BACKLOG_METRIC:
            return int(sum(sample.value for sample in family.samples))
    return None


def collect(server: str, timeout: float = 10.0) -> dict[str, Any]:
    """What `status` reports, as a JSON-able document."""
    base = server.rstrip("/")
    doc = json.loads(_get(base + "/status", timeout))
    backlog = upload_backlog(_get(base + "/metrics", timeout).decode())
    hits, misses = doc.get("ac_hits", 0), doc.get("ac_misses", 0)
    return {
        "server": base,
        "version": doc.get("version"),
        "used_bytes": doc.get("current_size_bytes"),
        "max_bytes": doc.get("max_size_bytes"),
        "blobs": doc.get("blob_count"),
        "action_entries": doc.get("ac_entries"),
        "ac_hits": hits,
        "ac_misses": misses,
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        "upload_backlog": backlog,
    }


def summary(report: dict[str, Any]) -> str:
    ratio = report["hit_ratio"]
    backlog = report["upload_backlog"]
    return (
        f"{report['server']}: {human_bytes(report['used_bytes'])} of {human_bytes(report['max_bytes'])}, "
        f"{report['blobs']} blobs, {report['action_entries']} action entries, "
        f"hit ratio {'-' if ratio is None else f'{100 * ratio:.1f}%'} "
        f"({report['ac_hits']} hits, {report['ac_misses']} misses), "
        f"upload backlog {'none (no bucket)' if backlog is None else backlog}"
    )


def run(server: str, as_json: bool) -> int:
    try:
        report = collect(server)
    except (StatusError, ValueError) as e:
        print(f"buildvault status: {e}", file=sys.stderr)
        return 1
    emit(summary(report), report, as_json)
    return 0
