#!/usr/bin/env python3
"""Two buildvault checkouts, interleaved, on the small-blob scenarios: before and after a change
to the disk store (issue 15: small blobs as LMDB records instead of a file each).

    .venv/bin/python bench/layout_ab.py --before OTHER/.venv/bin/python [--reps 5]
        [--scenarios 'batch_update_c1,batch_update_c8,batch_read_c1,batch_read_c8,ac_update_c1,ac_update_c16,fmb_c1']
        [--serve-args '--chunking false'] [--before-args ARGS] [--after-args ARGS]

`--before` and `--after` (default: this interpreter) are the Python of a venv each, with its
checkout's buildvault installed. Each repetition starts a fresh `buildvault serve` (fresh data
directory, loopback, no HTTP listener) from each side in turn, alternating which goes first,
runs this checkout's bench/harness.py against it, and stops it. Prints the median of every
scenario's throughput per side, min-max, the after/before ratio, the ratio of the server's CPU
per operation over the harness's own (lower is cheaper; steadier than throughput when the
machine's speed swings), and the load average. `--serve-args` are added to both servers' command
lines (e.g. `--chunking false`: the same scenarios with every blob stored whole); `--before-args`
and `--after-args` to one side's only (one checkout against itself:
`--before .venv/bin/python --before-args '--chunking false'`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "bench" / "harness.py"
SCENARIOS = "batch_update_c1,batch_update_c8,batch_read_c1,batch_read_c8,ac_update_c1,ac_update_c16,fmb_c1"
_READY = re.compile(r"buildvault ready: grpc=(\S+)")


def start(python: str, data_dir: Path, log: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    argv = [python, "-c", "import sys; from buildvault.cli import main; sys.exit(main())", "serve",
            "--grpc-address", "127.0.0.1:0", "--http-address", "", "--dir", str(data_dir),
            "--max-size", "20GiB", *extra]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = _READY.search(log.read_text(errors="replace"))
        if match:
            return process, match.group(1)
        if process.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise SystemExit("server not ready after 60 s")


def stop(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def run_once(python: str, scenarios: str, work: Path, extra: list[str]) -> dict[str, dict[str, Any]]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    process, address = start(python, work / "data", work / "server.log", extra)
    try:
        out = work / "results.json"
        subprocess.run([sys.executable, str(HARNESS), "--target", address, "--scenarios", scenarios,
                        "--server-pid", str(process.pid), "--json-out", str(out)],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        return {row["scenario"]: row for row in json.loads(out.read_text())["results"]}
    finally:
        stop(process)


def throughput(row: dict[str, Any]) -> tuple[float, str]:
    """The scenario's figure (higher is better for every scenario run here) and its unit."""
    if not row.get("ok", True) or row.get("value") is None:
        raise SystemExit(f"{row['scenario']} failed: {row.get('error')}")
    return float(row["value"]), str(row["unit"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="python of the venv of the checkout before")
    parser.add_argument("--after", default=sys.executable, help="python of the venv of the checkout after")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--scenarios", default=SCENARIOS)
    parser.add_argument("--serve-args", default="", help="more `buildvault serve` arguments for both sides")
    parser.add_argument("--before-args", default="", help="more `buildvault serve` arguments for the side before")
    parser.add_argument("--after-args", default="", help="more `buildvault serve` arguments for the side after")
    args = parser.parse_args()
    extra = {
        "before": shlex.split(args.serve_args) + shlex.split(args.before_args),
        "after": shlex.split(args.serve_args) + shlex.split(args.after_args),
    }
    sides = {"before": args.before, "after": args.after}
    figures: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    cpu: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}  # server CPU / harness CPU
    units: dict[str, str] = {}
    loads = []
    with tempfile.TemporaryDirectory(prefix="bv-ab-") as tmp:
        for rep in range(args.reps):
            order = ["before", "after"] if rep % 2 == 0 else ["after", "before"]
            for side in order:
                # One work area, emptied before every run: with the other side's blobs left on disk,
                # the "after" side's 64 KiB-chunk writes ran at 0.64x with the same code on both.
                rows = run_once(sides[side], args.scenarios, Path(tmp) / "run", extra[side])
                for name, row in rows.items():
                    value, unit = throughput(row)
                    units[name] = unit
                    figures[side].setdefault(name, []).append(value)
                    share = row.get("detail", {}).get("server_per_client_cpu")  # RSS rows have none
                    if share is not None:
                        cpu[side].setdefault(name, []).append(float(share))
                loads.append(os.getloadavg()[0])
                print(json.dumps({"rep": rep, "side": side, **{n: figures[side][n][-1] for n in rows}}), flush=True)
    print("\n| scenario | unit | before (median, min-max) | after (median, min-max) | after/before "
          "| server CPU / harness CPU, before / after | CPU after/before |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in figures["after"]:
        b, a = figures["before"].get(name, [0.0]), figures["after"][name]
        mb, ma = statistics.median(b), statistics.median(a)
        ratio = f"{ma / mb:.2f}x" if mb else "-"
        cb = statistics.median(cpu["before"].get(name, [0.0]))
        ca = statistics.median(cpu["after"].get(name, [0.0]))
        cpu_ratio = f"{ca / cb:.2f}x" if cb else "-"
        print(f"| {name} | {units[name]} | {mb:,.0f} ({min(b):,.0f}-{max(b):,.0f}) "
              f"| {ma:,.0f} ({min(a):,.0f}-{max(a):,.0f}) | {ratio} | {cb:.2f} / {ca:.2f} | {cpu_ratio} |")  # fmt: skip
    print(f"\nserve arguments: {args.serve_args or '(none)'}")
    print(f"{args.reps} repetitions, alternating order; load (1 min) {min(loads):.2f}-{max(loads):.2f}, "
          f"median {statistics.median(loads):.2f}; {os.cpu_count()} cores")  # fmt: skip


if __name__ == "__main__":
    main()
