"""`buildvault status`, `buildvault healthcheck` and `--log-format` against a real server."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from polling import wait_for

CLI = [sys.executable, "-m", "buildvault.cli"]


def _request(url: str, data: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=data, method="PUT" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code


def _traffic(base: str) -> None:
    """One AC miss and one AC hit over HTTP, and a blob."""
    blob = b"status test blob\n" * 100
    assert _request(f"{base}/cas/{hashlib.sha256(blob).hexdigest()}", blob) in (200, 201, 204)
    assert _request(f"{base}/ac/{'a' * 64}") == 404
    assert _request(f"{base}/ac/{'b' * 64}", b"opaque entry") in (200, 201, 204)
    assert _request(f"{base}/ac/{'b' * 64}") == 200


def test_status_reports_size_hits_and_backlog(buildvault_server) -> None:
    base = f"http://{buildvault_server.http_address}"
    _traffic(base)
    proc = subprocess.run([*CLI, "status", "--server", base, "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["used_bytes"] >= 1700 and report["max_bytes"] > report["used_bytes"]
    assert (report["ac_hits"], report["ac_misses"], report["hit_ratio"]) == (1, 1, 0.5)
    assert report["upload_backlog"] is None  # no bucket configured
    plain = subprocess.run([*CLI, "status", "--server", base], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stdout.count("\n") == 1
    assert "hit ratio 50.0%" in plain.stdout and "upload backlog none" in plain.stdout


def test_status_and_healthcheck_name_an_unreachable_server(buildvault_server) -> None:
    proc = subprocess.run([*CLI, "status", "--server", "http://127.0.0.1:9"], capture_output=True, text=True)
    assert proc.returncode == 1 and "--server" in proc.stderr and proc.stdout == ""
    bad = subprocess.run([*CLI, "healthcheck", "--http-address", "127.0.0.1:9"], capture_output=True, text=True)
    assert bad.returncode == 1 and "unhealthy" in bad.stderr
    good = subprocess.run(
        [*CLI, "healthcheck", "--http-address", buildvault_server.http_address], capture_output=True, text=True
    )
    assert good.returncode == 0 and good.stdout.startswith("healthy")


def test_log_format_text_and_json(buildvault_server_factory: Callable[..., Any]) -> None:
    text = buildvault_server_factory("text", log_level="debug", extra_args=["--log-format", "text"])
    _traffic(f"http://{text.http_address}")
    line = wait_for(
        lambda: next((ln for ln in text.output().splitlines() if "rpc=" in ln and "code=200" in ln), None),
        10,
        "a text request line",
    )
    assert " DEBUG buildvault.request request " in line and "ms=" in line
    assert not any(ln.startswith("{") for ln in text.output().splitlines())

    machine = buildvault_server_factory("json", log_level="debug")
    _traffic(f"http://{machine.http_address}")
    records = wait_for(
        lambda: [json.loads(ln) for ln in machine.output().splitlines() if ln.startswith('{"ts"')], 10, "JSON lines"
    )
    request = next(r for r in records if r.get("msg") == "request" and r.get("code") == "200")
    assert {"ts", "level", "rpc", "code", "ms"} <= request.keys()


def test_bad_log_format_is_refused(tmp_path) -> None:
    proc = subprocess.run(
        [*CLI, "serve", "--dir", str(tmp_path / "d"), "--log-format", "xml"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "log_format" in proc.stderr
    assert not (tmp_path / "d").exists()
