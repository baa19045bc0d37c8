"""The status page in headless Chromium (Debian's `chromium`): it loads without console errors
and without any request off the server (no CDN), its charts have data after some traffic, and
a screenshot is kept as an artifact of the run (in $BUILDVAULT_TEST_ARTIFACTS, else the test's
temporary directory, printed)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from polling import wait_for

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium")
    assert exe, "chromium is not installed: run scripts/install-system-deps.sh"
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"  # a fresh one per run
    return subprocess.run(
        [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def _put(url: str, data: bytes) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, data=data, method="PUT"), timeout=10):
        pass


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError:
        return b""


def _history(base: str) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = json.loads(_get(f"{base}/status/history"))["samples"]
    return samples


def test_status_page_charts_in_headless_chromium(buildvault_server, tmp_path: Path) -> None:
    base = f"http://{buildvault_server.http_address}"
    # Traffic in a few rounds, each followed by a sample, so every chart has a line.
    for round_ in range(3):
        for i in range(20):
            blob = os.urandom(4096)
            digest = hashlib.sha256(blob).hexdigest()
            _put(f"{base}/cas/{digest}", blob)
            _get(f"{base}/cas/{digest}")
            _get(f"{base}/ac/{hashlib.sha256(f'{round_} {i}'.encode()).hexdigest()}")  # misses
            _put(f"{base}/ac/{digest}", b"entry")
            _get(f"{base}/ac/{digest}")  # hits
        count = round_ + 2
        wait_for(lambda n=count: len(_history(base)) >= n, 10, f"{count} samples in the ring buffer")
    samples = _history(base)
    assert samples[-1]["ac_hits"] == 60 and samples[-1]["ac_misses"] == 60
    assert samples[-1]["bytes_in"] >= 60 * 4096 and samples[-1]["bytes_out"] >= 60 * 4096

    page = _get(f"{base}/status.html").decode()
    assert not re.search(r"""(?:src|href)=["']https?://""", page)  # nothing from elsewhere

    dom = _chromium(tmp_path, "--enable-logging=stderr", "--v=0", "--dump-dom", f"{base}/status.html")
    assert dom.returncode == 0, dom.stderr[-3000:]
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == [], console
    points = {label: int(n) for label, n in re.findall(r'data-label="([^"]+)" data-points="(\d+)"', dom.stdout)}
    assert set(points) >= {"hits", "in", "out", "used", "cap", "entries"}, points
    assert all(n >= 3 for n in points.values()), points

    artifacts = Path(os.environ.get("BUILDVAULT_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / "status-page.png"
    shot = _chromium(tmp_path, f"--screenshot={screenshot}", "--window-size=1280,900", f"{base}/status.html")
    assert shot.returncode == 0, shot.stderr[-3000:]
    data = screenshot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    print(f"status page screenshot: {screenshot}")
