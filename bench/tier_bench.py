#!/usr/bin/env python3
"""FindMissingBlobs and BatchReadBlobs with the object-store tier on vs disk only (issue 15, item 4).

    .venv/bin/python bench/tier_bench.py [--reps 2] [--warm]

Alternates fresh servers (`buildvault serve` on disk; the same on a moto_server bucket, see
servers.start_buildvault_on_bucket) and runs bench/harness.py's fmb_* and batch_read_* scenarios
against each; prints one line per run. `--warm` measures what the issue's target names, a warm
cache: every scenario runs once untimed first, and with the bucket the measured run starts once
the upload journal has drained. Not a timed test; figures go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import servers  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--warm", action="store_true", help="untimed run first; bucket uploads drained")
    args = parser.parse_args()
    for rep in range(args.reps):
        for kind in ("disk", "tier") if rep % 2 == 0 else ("tier", "disk"):
            work = Path(tempfile.mkdtemp(prefix="tier-bench-"))
            start = servers.start_buildvault if kind == "disk" else servers.start_buildvault_on_bucket
            port = servers.free_port()
            server = start(work / "data", work / "log", ["--http-address", f"127.0.0.1:{port}"])
            try:
                out = work / "results.json"
                warm = ["--warmup"] if args.warm else []
                if args.warm and kind == "tier":
                    warm += ["--wait-journal", f"http://127.0.0.1:{port}/metrics"]
                subprocess.run(
                    [sys.executable, str(ROOT / "bench" / "harness.py"), "--target", server.address,
                     "--scenarios", "fmb_*,batch_read_*", "--json-out", str(out), *warm],
                    check=True, capture_output=True,
                )  # fmt: skip
                results = json.loads(out.read_text())["results"]
                print(kind, {r["scenario"]: round(r["value"]) for r in results}, flush=True)
            finally:
                servers.stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
