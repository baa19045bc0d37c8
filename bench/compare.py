#!/usr/bin/env python3
"""buildvault vs BuildGrid 0.4.4 and 0.9.x, one command: writes a dated report to bench/notes/.

    .venv/bin/python bench/compare.py                  # full run, ~15 min on 2 cores
    .venv/bin/python bench/compare.py --scenarios 'fmb_*,ac_*' --reps 5 --no-bazel
    .venv/bin/python bench/compare.py --peers buildgrid  # without 0.9.x (no Python 3.13 here)

1. Installs BuildGrid from PyPI, once each, into git-ignored venvs: the newest release for this
   Python (0.4.4 on 3.11, unless --buildgrid-version) into bench/.venv-buildgrid, and
   buildgrid==0.9.1 (--buildgrid-09-version) into bench/.venv-buildgrid-0.9, made with a
   Python 3.13 (--python313; default `python3.13` on PATH, else `pyenv prefix 3.13`).
2. For each repetition and each server, in rotated order (A B C, B C A, C A B, ...): starts a
   fresh server on loopback with a fresh data directory (BuildGrid: disk CAS + AC kept in it;
   buildvault: `buildvault serve --dir D`), runs bench/harness.py against it with its PID for
   RSS sampling, stops it and deletes the data.
3. Times a warm Bazel build (all cache hits) through buildvault, through BuildGrid and with
   Bazel's own --disk_cache (bench/bazel_warm.py), rotated the same way.
   The harness runs with --client-warm unless --no-client-warm (its receive at its steady-state
   cost: see bench/harness.py); with --pin every server (and all it starts) runs on CPU 0 and
   the harness on CPU 1, the same for every server, so neither takes the other's core.
4. Writes medians, min-max and the buildvault/BuildGrid ratio against each BuildGrid per
   scenario, with the targets (met or not against 0.9.x, the current release), the exact
   command and the machine (cores, RAM, CPU model; no host names or paths), to
   bench/notes/compare-<UTC date and time>.md (or --out). bench/RESULTS.md is curated by hand:
   copy the table there when it becomes today's figures.

Exit status: 0 when every run passed its verification, 1 otherwise (the report is still written).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import servers  # noqa: E402

HARNESS = ROOT / "bench" / "harness.py"
PEERS = ("buildgrid", "buildgrid-0.9")  # every BuildGrid compare.py knows; --peers picks
PEER_LABELS = {"buildgrid": "BG 0.4.4", "buildgrid-0.9": "BG 0.9"}
TARGET_PEER = "buildgrid-0.9"  # the targets are ratios against the current release
RSS_LIMIT_MIB = 150.0

# scenario -> minimum buildvault/BuildGrid-0.9 ratio (throughput metrics), from issue 15
TARGETS: dict[str, float] = {
    "fmb_c1": 8.0,
    "fmb_c16": 8.0,
    "batch_update_c1": 3.0,
    "batch_read_c1": 3.0,
    "batch_update_c8": 3.0,
    "batch_read_c8": 3.0,
    "bs_write_512MiB_chunk1MiB": 2.0,
    "bs_read_512MiB": 1.2,
    "bs_write_64MiB_chunk16KiB": 1.5,
    "bs_write_64MiB_chunk64KiB": 1.5,
    "ac_update_c1": 2.0,
    "ac_update_c16": 3.0,
    "ac_get_c16": 2.5,
    "mixed_cold": 2.5,
    "mixed_warm": 2.5,
}
ABSOLUTE_TARGETS: dict[str, float] = {"server_rss_bs_512MiB": RSS_LIMIT_MIB}  # buildvault, MiB, lower


def log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# BuildGrid install
# --------------------------------------------------------------------------------------------


def buildgrid_version(venv: Path) -> str | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('buildgrid'))"],
        capture_output=True, text=True,
    )
    return probe.stdout.strip() if probe.returncode == 0 and servers.buildgrid_bgd(venv).exists() else None


def ensure_buildgrid(venv: Path, version: str | None, upgrade: bool, python: str = sys.executable) -> str:
    """BuildGrid `version` (None: the newest for `python`) in `venv`, made with `python`."""
    installed = buildgrid_version(venv)
    if installed and not upgrade and (version is None or installed == version):
        return installed
    if not (venv / "bin" / "python").exists():
        log(f"creating {venv.relative_to(ROOT)} with {python}")
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    requirement = f"buildgrid=={version}" if version else "buildgrid"
    log(f"pip install {requirement} into {venv.relative_to(ROOT)}")
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         *(["--upgrade"] if upgrade or not version else []), requirement],
        check=True,
    )
    installed = buildgrid_version(venv)
    if not installed:
        raise SystemExit("BuildGrid did not install: no bgd in the venv")
    return installed


def find_python313(explicit: str | None) -> str:
    """An interpreter that can install BuildGrid 0.9.x: --python313, `python3.13`, pyenv's 3.13."""
    candidates = [explicit] if explicit else [shutil.which("python3.13")]
    if not explicit and shutil.which("pyenv"):
        probe = subprocess.run(["pyenv", "prefix", "3.13"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip():
            candidates.append(str(Path(probe.stdout.strip().splitlines()[0]) / "bin" / "python3.13"))
    for candidate in candidates:
        if not candidate:
            continue
        # a pyenv shim exists even when 3.13 is not the selected version: it must really run
        probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] >= (3, 13))"],
                               capture_output=True, text=True)  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return candidate
    raise SystemExit(
        "BuildGrid 0.9.x needs Python >= 3.13: pass --python313 PATH (e.g. `pyenv install 3.13`), "
        "or leave it out with --peers buildgrid"
    )


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


SERVER_CPUS, HARNESS_CPUS = {0}, {1}  # --pin


def start(
    name: str,
    data_dir: Path,
    log_path: Path,
    bucket: bool = False,
    cpus: set[int] | None = None,
    chunks_at_rest: bool = False,
) -> servers.Server:
    extra = ["--chunking-backlog", "0"] if chunks_at_rest else []
    if name == "buildvault" and bucket:
        return servers.start_buildvault_on_bucket(data_dir, log_path, extra, cpus=cpus)
    if name == "buildvault":
        return servers.start_buildvault(data_dir, log_path, extra, cpus=cpus)
    if name == "buildgrid-0.9":
        return servers.start_buildgrid_09(data_dir, log_path, cpus=cpus)
    return servers.start_buildgrid(data_dir, log_path, cpus=cpus)


def run_harness(server: servers.Server, args: argparse.Namespace, out: Path, log_path: Path) -> dict[str, Any]:
    argv = [
        sys.executable, str(HARNESS), "--target", server.address, "--server-pid", str(server.pid),
        "--label", server.name, "--json-out", str(out),
    ]
    if args.quick:
        argv.append("--quick")
    if args.scenarios:
        argv += ["--scenarios", args.scenarios]
    if args.client_warm:
        argv.append("--client-warm")
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as handle:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                   preexec_fn=servers.pinned(HARNESS_CPUS if args.pin else None))  # fmt: skip
        assert process.stdout is not None
        for line in process.stdout:
            handle.write(line)
            if line.startswith("{"):
                row = json.loads(line)
                value = row.get("value")
                shown = f"{value:,.1f} {row['unit']}" if isinstance(value, (int, float)) else f"FAILED {row['error']}"
                log(f"  {server.name:10} {row['scenario']:28} {shown}")
        process.wait(timeout=args.run_timeout)
    document: dict[str, Any] = {"results": []}
    if out.exists():
        document = json.loads(out.read_text(encoding="utf-8"))
    document["exit_code"] = process.returncode
    document["wall_s"] = time.monotonic() - started
    if process.returncode != 0:
        log(f"  {server.name}: harness exited {process.returncode}; server log tail:\n{server.log_tail(1500)}")
    return document


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def machine_info() -> dict[str, str]:
    info = {"cores": str(os.cpu_count())}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["ram"] = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["kernel"] = platform.release()
    info["python"] = platform.python_version()
    try:
        import grpc

        info["grpcio (client, buildvault)"] = grpc.__version__
    except ImportError:
        pass
    return info


def git_revision() -> str:
    probe = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "src"], cwd=ROOT,
                           capture_output=True, text=True)
    revision = probe.stdout.strip() or "unknown"
    return revision + (" (+ uncommitted changes under src/)" if dirty.stdout.strip() else "")


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def summarize(runs: dict[str, list[dict[str, Any]]]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Per scenario: values per server (rep order kept), per-rep ratios buildvault/peer per peer."""
    names = list(runs)
    order: list[str] = []
    table: dict[str, dict[str, Any]] = {}
    reps = max(len(v) for v in runs.values())
    for name in names:
        for rep, document in enumerate(runs[name]):
            for row in document.get("results", []):
                scenario = row["scenario"]
                if scenario not in table:
                    order.append(scenario)
                    table[scenario] = {
                        "unit": row["unit"], "higher": row["higher_is_better"],
                        "values": {s: [None] * reps for s in names}, "errors": [],
                    }
                entry = table[scenario]
                entry["unit"] = entry["unit"] or row["unit"]
                if row["ok"] and row["value"] is not None:
                    entry["values"][name][rep] = row["value"]
                else:
                    entry["errors"].append(f"{name} run {rep + 1}: {row['error']}")
    for entry in table.values():
        entry["ratios"] = {}
        for peer in names[1:]:
            pairs = zip(entry["values"]["buildvault"], entry["values"][peer], strict=True)
            entry["ratios"][peer] = [a / b for a, b in pairs if a is not None and b]
    return order, table


def stats(values: list[float | None]) -> tuple[float | None, float | None, float | None]:
    present = [v for v in values if v is not None]
    if not present:
        return None, None, None
    return statistics.median(present), min(present), max(present)


def target_peer(names: list[str]) -> str:
    return TARGET_PEER if TARGET_PEER in names else names[1]


def verdict(scenario: str, entry: dict[str, Any], peer: str) -> tuple[str, str]:
    """(target text, met?) with the ratio against `peer`."""
    if scenario in TARGETS:
        want = TARGETS[scenario]
        if not entry["ratios"][peer]:
            return f"≥ {want:g}×", "—"
        ratio = statistics.median(entry["ratios"][peer])
        return f"≥ {want:g}×", "yes" if ratio >= want else "**no**"
    if scenario in ABSOLUTE_TARGETS:
        limit = ABSOLUTE_TARGETS[scenario]
        median = stats(entry["values"]["buildvault"])[0]
        if median is None:
            return f"< {limit:g} MiB", "—"
        return f"buildvault < {limit:g} MiB", "yes" if median < limit else "**no**"
    return "", ""


def cpu_table(
    order: list[str], table: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]], names: list[str]
) -> list[str]:
    """CPU ms per operation of each server's process tree and of the harness, medians over the runs."""
    per: dict[tuple[str, str, str], list[float]] = {}
    for name in names:
        for document in runs[name]:
            for row in document.get("results", []):
                for key in ("server_cpu_us_per_op", "client_cpu_us_per_op"):
                    value = (row.get("detail") or {}).get(key)
                    if row.get("ok") and isinstance(value, (int, float)):
                        per.setdefault((row["scenario"], name, key), []).append(value / 1000)
    rows = [s for s in order if any((s, n, "server_cpu_us_per_op") in per for n in names)]
    if not rows:
        return []
    lines = [
        "CPU per operation, ms (median over runs): the server's process tree / the harness. A throughput",
        "whose harness CPU is near the wall time per operation measures the client, not the server.",
        "",
        "| scenario | " + " | ".join(f"{n} server / harness" for n in names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    for scenario in rows:
        cells = []
        for name in names:
            server = stats(per.get((scenario, name, "server_cpu_us_per_op"), []))[0]
            client = stats(per.get((scenario, name, "client_cpu_us_per_op"), []))[0]
            cells.append(f"{fmt(server, 2)} / {fmt(client, 2)}")
        lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
    return lines + [""]


def span(values: tuple[float | None, float | None, float | None], digits: int = 1) -> str:
    """median (min–max)"""
    return f"{fmt(values[0], digits)} ({fmt(values[1], digits)}–{fmt(values[2], digits)})"


def write_report(
    path: Path, args: argparse.Namespace, command: str, runs: dict[str, list[dict[str, Any]]],
    bazel: dict[str, Any] | None, bazel_error: str | None, meta: dict[str, Any],
) -> None:
    order, table = summarize(runs)
    names = list(runs)
    peers = names[1:]
    goal = target_peer(names)
    versions = ", ".join(f"BuildGrid {meta['buildgrid'][peer]}" for peer in peers)
    lines = [
        "# buildvault vs BuildGrid: benchmark results",
        "",
        "Written by `bench/compare.py`. All servers on loopback on the same",
        "machine as the client (bench/harness.py, one grpc.aio channel), each run on a fresh server",
        "with an empty data directory, the servers interleaved in rotated order. Every read-back",
        "was verified. Noise between runs is about ±30 %: read the ratio (buildvault / BuildGrid,",
        "computed within each repetition, median over repetitions), not single times. For",
        "throughput a ratio above 1 means buildvault is faster; for memory (MiB) below 1 is better.",
        "",
        "```sh",
        command,
        "```",
        "",
        f"- date (UTC): {meta['date']}; wall time of the whole comparison: {meta['wall_min']:.1f} min;",
        f"  load average (1/5/15 min) at start {meta['load_start']}, at end {meta['load_end']}"
        " (anything above ~1 is other work sharing the 2 cores)",
        f"- buildvault revision {meta['revision']}; {versions} (PyPI), each a disk CAS,",
        "  LRU action cache stored in that CAS, no auth, no monitoring, thread-pool-size 64",
        "  (0.9.x also: maximum-concurrent-rpcs 32, grpc.so_reuseport 0)",
        f"- targets (issue 15) are ratios against {PEER_LABELS[goal]}; the machine is shared with other work,",
        "  so read the load average above beside the figures",
        f"- repetitions: {args.reps}{' (quick sizes)' if args.quick else ''}"
        + ("; buildvault with the object-store tier on (moto_server on loopback)" if args.bucket else "")
        + ("; buildvault with `--chunking-backlog 0` (blobs of 2 MiB or more read as chunks)"
           if args.chunks_at_rest else "")
        + (f"; scenarios: `{args.scenarios}`" if args.scenarios else ""),
        "- machine: " + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()),
        "- client: " + ("--client-warm (memory kept, each ByteStream blob read once untimed first)"
                        if args.client_warm else "cold (--no-client-warm)")
        + ("; CPUs pinned: every server on CPU 0, the harness on CPU 1 (--pin)" if args.pin
           else "; CPUs not pinned (servers and harness share both cores)"),
        "",
        "## REAPI scenarios",
        "",
        "| scenario | unit | buildvault median (min–max) | "
        + " | ".join(f"{PEER_LABELS[p]} median (min–max)" for p in peers) + " | "
        + " | ".join(f"ratio bv/{PEER_LABELS[p]}" for p in peers) + f" | target vs {PEER_LABELS[goal]} | met |",
        "| --- | --- |" + " ---: |" * (1 + 2 * len(peers)) + " --- | --- |",
    ]
    for scenario in order:
        entry = table[scenario]
        target, met = verdict(scenario, entry, goal)
        cells = [span(stats(entry["values"][name])) for name in names]
        for peer in peers:
            median, low, high = stats(entry["ratios"][peer])
            cells.append(f"**{fmt(median, 2)}** ({fmt(low, 2)}–{fmt(high, 2)})")
        lines.append(f"| {scenario} | {entry['unit']} | " + " | ".join(cells) + f" | {target} | {met} |")
    errors = [e for s in order for e in table[s]["errors"]]
    failed_runs = [f"{name} run {i + 1}: exit {d.get('exit_code')}" for name in names
                   for i, d in enumerate(runs[name]) if d.get("exit_code") != 0]
    lines += [""] + cpu_table(order, table, runs, names)
    if errors or failed_runs:
        lines += ["**Failures** (the comparison exits 1):", ""] + [f"- {e}" for e in failed_runs + errors] + [""]
    else:
        lines += ["Every run passed every verification.", ""]
    lines += [
        "Scenarios: `fmb_cN` FindMissingBlobs of 1,000 digests (half present), N concurrent callers;",
        "`batch_*_cN` 100 blobs of 4 KiB per call; `bs_write_S_chunkC` ByteStream.Write of S-byte",
        "blobs in C-byte chunks, `bs_read_S` ByteStream.Read (the server picks its chunk size);",
        "`ac_*_cN` ActionCache with 3 outputs per result; `mixed_cold` 8 simulated build clients",
        "(GetActionResult miss → FindMissingBlobs → BatchUpdateBlobs + ByteStream.Write →",
        "UpdateActionResult), `mixed_warm` the same actions again (hit → read every output);",
        "`server_rss_*` peak resident memory of the server's process tree less file-backed pages",
        "(mapped libraries, buildvault's LMDB data file: page cache), sampled every 20 ms (whole run,",
        "and while streaming the 512 MiB blobs). Harness wall time per run: "
        + ", ".join(
            f"{name} {statistics.median([d['wall_s'] for d in runs[name]]):.0f} s" for name in names if runs[name]
        )
        + ".",
        "",
        "## A real client: warm Bazel build",
        "",
    ]
    if bazel:
        backends = bazel["backends"]
        disk = backends.get("disk_cache", {}).get("warm_median_s")
        lines += [
            f"Bazel {meta.get('bazel', '')}, tests/e2e/bazel_workspace plus {bazel['libs']} generated C++ libraries:",
            f"{bazel['cacheable_spawns']} cacheable spawns, every one a cache hit in the timed builds",
            f"(`bazel clean` then `bazel build //...`, {bazel['reps']} repetitions, backends rotated; outputs",
            "downloaded, the binary run and its output checked).",
            "",
            "| backend | warm build median (min–max) s | time / --disk_cache time (min–max) | cold build s |",
            "| --- | ---: | ---: | ---: |",
        ]
        disk_times = backends.get("disk_cache", {}).get("warm_s", [])
        for name, figures in backends.items():
            median, low, high = stats(figures["warm_s"])
            ratios = [t / d for t, d in zip(figures["warm_s"], disk_times, strict=False) if d]
            r_median, r_low, r_high = stats(ratios)
            relative = f"**{r_median:.2f}×** ({r_low:.2f}–{r_high:.2f})" if r_median and disk else "—"
            lines.append(
                f"| {name} | {fmt(median, 2)} ({fmt(low, 2)}–{fmt(high, 2)}) | {relative} "
                f"| {fmt(figures['cold_s'], 1)} |"
            )
        lines += [
            "",
            "The ratio is taken within each repetition (same minute, rotated order), median over",
            "repetitions; below 1 would mean faster than Bazel's local disk cache.",
            "",
        ]
    elif bazel_error:
        lines += [f"Not measured: {bazel_error}", ""]
    else:
        lines += ["Not measured in this run (`--no-bazel`).", ""]
    lines += [
        "<details><summary>Every run's values</summary>",
        "",
        "| scenario | " + " | ".join(f"{name} run {i + 1}" for name in names for i in range(args.reps)) + " |",
        "| --- |" + " ---: |" * (len(names) * args.reps),
    ]
    for scenario in order:
        values = [table[scenario]["values"][name][i] if i < len(table[scenario]["values"][name]) else None
                  for name in names for i in range(args.reps)]
        lines.append(f"| {scenario} | " + " | ".join(fmt(v) for v in values) + " |")
    lines += ["", "</details>", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def bazel_version() -> str:
    try:
        probe = subprocess.run(["bazel", "--version"], capture_output=True, text=True, timeout=120)
        version = probe.stdout.strip().replace("bazel ", "")
        if version in ("", "no_version"):  # Debian's bazel-bootstrap says no_version
            probe = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "bazel-bootstrap"],
                                   capture_output=True, text=True, timeout=30)
            version = probe.stdout.strip().split("+")[0] or version
        return version
    except (OSError, subprocess.TimeoutExpired):
        return ""


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run_bazel(args: argparse.Namespace, workdir: Path, peers: list[str]) -> dict[str, Any]:
    from bench import bazel_warm

    started: list[servers.Server] = []
    try:
        bv = servers.start_buildvault(workdir / "bazel-bv-data", workdir / "bazel-bv.log")
        started.append(bv)
        backends: dict[str, dict[str, Any]] = {
            "buildvault": {"remote_cache": f"grpc://{bv.address}"},
            "disk_cache": {"disk_cache": workdir / "bazel-disk-cache"},
        }
        for peer in peers:
            server = start(peer, workdir / f"bazel-{peer}-data", workdir / f"bazel-{peer}.log")
            started.append(server)
            backends[peer] = {"remote_cache": f"grpc://{server.address}"}
        return bazel_warm.run(backends, workdir / "bazel", libs=args.bazel_libs, reps=args.bazel_reps, log=log)
    finally:
        for server in started:
            servers.stop(server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="repetitions per server (default %(default)s)")
    parser.add_argument("--scenarios", help="harness scenario filter, e.g. 'fmb_*,bs_*_512MiB*'")
    parser.add_argument("--quick", action="store_true", help="harness --quick sizes (a smoke test of this script)")
    parser.add_argument("--no-bazel", action="store_true", help="skip the warm Bazel build figure")
    parser.add_argument("--bucket", action="store_true",
                        help="buildvault with the object-store tier on (the S3 test server on loopback)")  # fmt: skip
    parser.add_argument("--chunks-at-rest", action="store_true",
                        help="buildvault cuts every blob of 2 MiB or more as it arrives (--chunking-backlog 0): reads "
                        "are of chunks, as once an idle server has converted what it stored whole")  # fmt: skip
    parser.add_argument("--no-client-warm", dest="client_warm", action="store_false",
                        help="run the harness without --client-warm (a cold client: first-touch memory)")  # fmt: skip
    parser.add_argument("--pin", action="store_true",
                        help="every server (and what it starts) on CPU 0, the harness on CPU 1")  # fmt: skip
    parser.add_argument("--bazel-libs", type=int, default=60, help="generated libraries in the Bazel build")
    parser.add_argument("--bazel-reps", type=int, default=5, help="timed warm builds per backend")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="BuildGrid lines to compare with, comma-separated (default %(default)s)")  # fmt: skip
    parser.add_argument("--buildgrid-version", help="pin BuildGrid 0.4.x (default: newest for this Python)")
    parser.add_argument("--buildgrid-09-version", default="0.9.1", help="BuildGrid 0.9.x (default %(default)s)")
    parser.add_argument("--python313", help="Python >= 3.13 to make the BuildGrid 0.9.x venv with")
    parser.add_argument("--upgrade-buildgrid", action="store_true", help="reinstall/upgrade BuildGrid first")
    parser.add_argument("--out", help="report path (default bench/notes/compare-<UTC date and time>.md)")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="limit of one harness run, seconds")
    args = parser.parse_args(argv)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown or not peers:
        parser.error(f"--peers takes one or more of {', '.join(PEERS)}; got {args.peers!r}")
    names = ["buildvault", *peers]
    if args.pin and not os.sched_getaffinity(0) >= (SERVER_CPUS | HARNESS_CPUS):
        parser.error(f"--pin needs CPUs {sorted(SERVER_CPUS | HARNESS_CPUS)}; this process may use "
                     f"{sorted(os.sched_getaffinity(0))}")  # fmt: skip

    started_at = time.monotonic()
    command = " ".join(
        [".venv/bin/python", "bench/compare.py", *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))]
    )
    meta: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "load_start": load_average(),
        "machine": machine_info(),
        "revision": git_revision(),
    }
    meta["buildgrid"] = {}
    if "buildgrid" in peers:
        meta["buildgrid"]["buildgrid"] = ensure_buildgrid(
            servers.BUILDGRID_VENV, args.buildgrid_version, args.upgrade_buildgrid
        )
    if "buildgrid-0.9" in peers:
        meta["buildgrid"]["buildgrid-0.9"] = ensure_buildgrid(
            servers.BUILDGRID_09_VENV, args.buildgrid_09_version, args.upgrade_buildgrid,
            python=find_python313(args.python313),
        )
    log(f"BuildGrid {meta['buildgrid']}; buildvault {meta['revision']}")

    stamp = datetime.now(UTC).strftime("%Y-%m-%d-%H%M")
    out = Path(args.out) if args.out else ROOT / "bench" / "notes" / f"compare-{stamp}.md"
    workdir = Path(tempfile.mkdtemp(prefix="buildvault-compare-"))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    bazel: dict[str, Any] | None = None
    bazel_error: str | None = None
    try:
        for rep in range(args.reps):
            shift = rep % len(names)
            order = names[shift:] + names[:shift]
            for name in order:
                log(f"repetition {rep + 1}/{args.reps}: {name}")
                data = workdir / f"{name}-{rep}"
                server = start(name, data, workdir / f"{name}-{rep}.log", bucket=args.bucket,
                               cpus=SERVER_CPUS if args.pin else None, chunks_at_rest=args.chunks_at_rest)  # fmt: skip
                try:
                    runs[name].append(
                        run_harness(server, args, workdir / f"{name}-{rep}.json", workdir / f"{name}-{rep}.out")
                    )
                finally:
                    servers.stop(server)
                    servers.remove(data)
        if not args.no_bazel:
            meta["bazel"] = bazel_version()
            try:
                bazel = run_bazel(args, workdir, peers)
            except Exception as exc:
                bazel_error = f"{type(exc).__name__}: {str(exc)[:600]}"
                log(f"bazel figure failed: {bazel_error}")
        meta["wall_min"] = (time.monotonic() - started_at) / 60
        meta["load_end"] = load_average()
        write_report(out, args, command, runs, bazel, bazel_error, meta)
        log(f"wrote {out}")
    finally:
        servers.remove(workdir)
    ok = all(d.get("exit_code") == 0 for docs in runs.values() for d in docs) and bazel_error is None
    print(out.read_text(encoding="utf-8"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
