"""bench/floors.py --quick: both floor servers answer every harness scenario and pass its checks.

The floor servers (bench/floor_server.py) keep blobs in a dict; a floor that answered wrongly
would make every "target above the floor" line in RESULTS.md meaningless, so the harness's
byte-for-byte verification runs against them here, with buildvault beside them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_floors_quick_run_verifies_every_server() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/floors.py", "--quick", "--reps", "1", "--no-peer"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and re.fullmatch(r"[a-z0-9_]+", cells[0]) and cells[0] != "scenario":
            rows[cells[0]] = cells
    for scenario in ("capabilities", "fmb_c1", "batch_read_c8", "ac_get_c1", "mixed_warm"):
        assert scenario in rows, proc.stdout
        for value in rows[scenario][2:5]:  # buildvault, floor aio, floor sync: a measured rate each
            assert float(value.replace(",", "")) > 0, rows[scenario]
        # the CPU ratio: a number, or a dash where a quick section was shorter than the 10 ms clock tick
        assert re.fullmatch(r"—|[0-9]+\.[0-9]{2}", rows[scenario][6]), rows[scenario]
    assert "FAILED" not in proc.stderr, proc.stderr[-4000:]
    for figure in ("SHA-256, one thread, 4 KiB buffers", "write 4 KiB + fdatasync, median"):
        assert re.search(rf"\| {re.escape(figure)} \| [0-9.,]+ (MB/s|ms) \|", proc.stdout), proc.stdout
    page_cache = re.search(r"\| write\(\) 512 MiB into the page cache[^|]*\| ([0-9,]+) / ([0-9,]+) MiB/s", proc.stdout)
    assert page_cache and all(float(g.replace(",", "")) > 0 for g in page_cache.groups()), proc.stdout
