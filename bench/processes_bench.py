#!/usr/bin/env python3
"""buildvault with 1 vs N server processes (`--processes`, issue 15 item 3), in one interleaved sitting.

    .venv/bin/python bench/processes_bench.py                       # 1 vs 2, 5 reps, 16 connections
    .venv/bin/python bench/processes_bench.py --processes 1,2 --reps 3 --scenarios 'fmb_c16,ac_get_c16'

Each repetition starts a fresh `buildvault serve --processes N --local-workers 0` per process
count, in rotated order (1 2, 2 1, ...), runs bench/harness.py against it with `--channels`
connections (the same for every N: SO_REUSEPORT spreads connections, not calls, over the
processes), stops it and deletes the data. Prints the medians (min-max), the p50 latencies, the
ratio of each N to the first and the server's CPU per operation (the primary's and the
secondaries', from /proc: what scaling can be on an idle machine, whatever the load now), with
the load average before and after, as markdown.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import servers  # noqa: E402
from bench.harness import cpu_seconds  # noqa: E402

HARNESS = ROOT / "bench" / "harness.py"
SCENARIOS = (
    "fmb_c1,fmb_c16,batch_update_c1,batch_read_c1,batch_update_c8,batch_read_c8,ac_update_c1,ac_get_c1,"
    "ac_update_c16,ac_get_c16"
)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def server_cpu(server: servers.Server) -> tuple[float, float]:
    """(the primary's CPU seconds, its children's: the secondaries)."""
    children = []
    for task in Path(f"/proc/{server.pid}/task").iterdir():
        children += [int(p) for p in (task / "children").read_text().split()]
    return cpu_seconds(server.pid), sum(cpu_seconds(c) for c in children)


def run_once(processes: int, args: argparse.Namespace, work: Path, rep: int) -> dict[str, dict[str, Any]]:
    """One server, one harness run per scenario (in order: reads follow their writes' server), each
    scenario's server CPU measured around it."""
    data = work / f"data-{processes}-{rep}"
    server = servers.start_buildvault(
        data, work / f"server-{processes}-{rep}.log", ["--processes", str(processes), "--local-workers", "0"]
    )
    results: dict[str, dict[str, Any]] = {}
    try:
        for scenario in args.scenarios.split(","):
            out = work / f"result-{processes}-{rep}-{scenario}.json"
            argv = [
                sys.executable, str(HARNESS), "--target", server.address, "--label", f"buildvault x{processes}",
                "--json-out", str(out), "--scenarios", scenario, "--channels", str(args.channels),
            ]  # fmt: skip
            before = server_cpu(server)
            run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=args.run_timeout)
            after = server_cpu(server)
            if run.returncode != 0:
                print(run.stdout[-3000:], run.stderr[-3000:], server.log_tail(), file=sys.stderr)
                raise SystemExit(f"harness failed against --processes {processes}")
            (result,) = [r for r in json.loads(out.read_text())["results"] if r["scenario"] == scenario]
            # includes the scenario's own set-up (uploads before a read): CPU per op, a ratio between runs
            result["cpu_primary_ms"] = 1000 * (after[0] - before[0]) / max(1, result["ops"])
            result["cpu_secondaries_ms"] = 1000 * (after[1] - before[1]) / max(1, result["ops"])
            results[scenario] = result
    finally:
        servers.stop(server)
        shutil.rmtree(data, ignore_errors=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", default="1,2", help="process counts to compare (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--channels", type=int, default=16, help="client connections (default %(default)s)")
    parser.add_argument("--scenarios", default=SCENARIOS)
    parser.add_argument("--run-timeout", type=float, default=900.0)
    args = parser.parse_args()
    counts = [int(n) for n in args.processes.split(",")]
    runs: dict[int, list[dict[str, dict[str, Any]]]] = {n: [] for n in counts}
    load_before = load_average()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bv-procs-") as tmp:
        for rep in range(args.reps):
            order = counts[rep % len(counts) :] + counts[: rep % len(counts)]
            for n in order:
                runs[n].append(run_once(n, args, Path(tmp), rep))
                print(f"rep {rep + 1}/{args.reps} --processes {n} done (load {load_average()})", file=sys.stderr)
    load_after = load_average()
    base = counts[0]
    print(f"{args.reps} reps, {args.channels} connections, {time.monotonic() - started:.0f} s; "
          f"load average before {load_before}, after {load_after}\n")  # fmt: skip
    header = "| scenario | unit | " + " | ".join(f"x{n} median (min-max)" for n in counts)
    header += " | " + " | ".join(f"x{n} p50 ms" for n in counts)
    header += " | " + " | ".join(f"x{n}/x{base}" for n in counts[1:])
    header += " | " + " | ".join(f"x{n} server CPU ms/op (primary + secondaries)" for n in counts) + " |"
    print(header)
    print("|" + " --- |" * (2 + 3 * len(counts) + len(counts) - 1))
    for scenario in [s for s in args.scenarios.split(",") if s in runs[base][0]]:
        values = {n: [r[scenario]["value"] for r in runs[n]] for n in counts}
        p50 = {n: statistics.median(r[scenario]["p50_ms"] for r in runs[n]) for n in counts}
        medians = {n: statistics.median(v) for n, v in values.items()}
        unit = runs[base][0][scenario]["unit"]
        cells = [f"{medians[n]:,.0f} ({min(values[n]):,.0f}-{max(values[n]):,.0f})" for n in counts]
        cells += [f"{p50[n]:.2f}" for n in counts]
        cells += [f"{medians[n] / medians[base]:.2f}" for n in counts[1:]]
        for n in counts:
            primary = statistics.median(r[scenario]["cpu_primary_ms"] for r in runs[n])
            others = statistics.median(r[scenario]["cpu_secondaries_ms"] for r in runs[n])
            cells.append(f"{primary:.2f} + {others:.2f}")
        print(f"| {scenario} | {unit} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
