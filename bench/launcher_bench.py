#!/usr/bin/env python3
"""Wall times of bazel_example/ (CMake + Ninja, -j2) with and without buildvault-cc, vs ccache.

    .venv/bin/python bench/launcher_bench.py [--runs 3] [--jobs 2] [--json out.json]

Measures (median of --runs interleaved rounds, each a fresh build directory; "total" =
configure + build, "build" = the build step alone, "CPU" = CPU seconds of every process of
the build incl. the buildvault agent; the server's CPU is reported apart: in a fleet it runs
on another machine):
  none            no launcher
  ccache cold     ccache local mode, empty cache
  ccache warm     ccache local mode, build dir deleted, cache full
  buildvault cold, agent start   buildvault-cc, empty server, no agent yet (starts it)
  buildvault cold buildvault-cc, empty server, agent already running (it outlives builds)
  buildvault warm buildvault-cc, build dir deleted, every compile a remote hit
  buildvault warm -IS   the same through `buildvault-cc --install-fast` (python -IS start-up)
On a shared machine prefer "best" (least disturbed run) and CPU over the medians.
Targets (issue 6): buildvault warm <= 2x ccache warm; buildvault cold <= none + 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "bazel_example"
LAUNCHER = str(Path(sys.executable).parent / "buildvault-cc")
MODES = ("none", "ccache cold", "ccache warm", "buildvault cold, agent start", "buildvault cold", "buildvault warm",
         "buildvault warm -IS")


SERVER_PYTHONPATH: str | None = None
Sample = tuple[float, ...]  # (total, build step, CPU[, server CPU]) seconds


def start_server(data: Path) -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUILDVAULT_")}
    if SERVER_PYTHONPATH:
        env["PYTHONPATH"] = SERVER_PYTHONPATH
    proc = subprocess.Popen(
        [sys.executable, "-m", "buildvault.cli", "serve", "--dir", str(data), "--grpc-address", "127.0.0.1:0",
         "--http-address", "", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("buildvault ready:"):
            address = line.split("grpc=")[1].split()[0]
            return proc, address
    raise RuntimeError("server did not start")


def generator() -> list[str]:
    return ["-G", "Ninja"] if shutil.which("ninja") else ["-G", "Unix Makefiles"]


def build(checkout: Path, env: dict[str, str], launcher: str | None, jobs: int) -> tuple[float, float, float]:
    """(total seconds, build-step seconds, CPU seconds of the build's processes) of a from-scratch
    configure + build."""
    build_dir = checkout / "build"
    shutil.rmtree(build_dir, ignore_errors=True)
    configure = ["cmake", "-S", str(checkout), "-B", str(build_dir), *generator(), "-DCMAKE_CXX_COMPILER=g++"]
    if launcher:
        configure.append(f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}")
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run(configure, env=env, check=True, capture_output=True)
    mid = time.monotonic()
    subprocess.run(["cmake", "--build", str(build_dir), "--", f"-j{jobs}"], env=env, check=True, capture_output=True)
    end = time.monotonic()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return end - start, end - mid, cpu


def process_cpu(pid: int | None) -> float:
    """utime + stime of a (non-child) process, seconds."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def agent_pid(env: dict[str, str]) -> int | None:
    out = subprocess.run([LAUNCHER, "--agent-status"], env=env, capture_output=True, text=True).stdout
    try:
        return int(out.split('"pid":')[1].split("}")[0].split(",")[0])
    except (IndexError, ValueError):
        return None


def launcher_env(base: dict[str, str], address: str, work: Path, tag: str) -> dict[str, str]:
    return dict(base, BUILDVAULT_REMOTE=f"grpc://{address}", BUILDVAULT_WRITER="1",
                BUILDVAULT_AGENT_DIR=tempfile.mkdtemp(prefix="bvcc-", dir="/tmp"),
                BUILDVAULT_PLATFORM="soc=ascend910b1,cann=8.0.RC3",
                BUILDVAULT_EVENT_LOG=str(work / f"events-{tag}.jsonl"))


def prime(env: dict[str, str], work: Path) -> None:
    """Start the agent with one unrelated tiny compile."""
    d = work / "prime"
    d.mkdir(exist_ok=True)
    (d / "p.c").write_text("int prime_the_agent(void) { return 1; }\n")
    subprocess.run([LAUNCHER, "gcc", "-c", "p.c", "-o", "p.o"], cwd=d, env=env, check=True, capture_output=True)
    subprocess.run([LAUNCHER, "--flush"], env=env, check=True, capture_output=True)


def measured(checkout: Path, env: dict[str, str], launcher: str, jobs: int,
             server: subprocess.Popen[str]) -> Sample:
    """build() plus the CPU the agent spent meanwhile, and the server's CPU apart."""
    server_cpu = process_cpu(server.pid)
    before = agent_pid(env)
    agent_cpu = process_cpu(before)
    total, step, cpu = build(checkout, env, launcher, jobs)
    subprocess.run([LAUNCHER, "--flush"], env=env, capture_output=True)
    after = agent_pid(env)
    agent_cpu = process_cpu(after) - (agent_cpu if after == before else 0.0)
    return total, step, cpu + agent_cpu, process_cpu(server.pid) - server_cpu


def stop(env: dict[str, str], server: subprocess.Popen[str]) -> None:
    subprocess.run([LAUNCHER, "--stop-agent"], env=env, capture_output=True)
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(30)


def median(samples: list[Sample]) -> dict[str, Any]:
    return {
        "total": round(statistics.median(s[0] for s in samples), 3),
        "best": round(min(s[0] for s in samples), 3),
        "build": round(statistics.median(s[1] for s in samples), 3),
        "cpu": round(statistics.median(s[2] for s in samples), 3),
        "samples": [[round(x, 3) for x in sample] for sample in samples],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--server-pythonpath", default=None,
                        help="run the server from this source dir (e.g. an exported commit)")
    args = parser.parse_args()
    global SERVER_PYTHONPATH
    SERVER_PYTHONPATH = args.server_pythonpath
    work = Path(tempfile.mkdtemp(prefix="bvcc-bench-"))
    checkout = work / "checkout"
    shutil.copytree(EXAMPLE, checkout, ignore=shutil.ignore_patterns("build", "_build", "bazel-*"))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("BUILDVAULT_", "CCACHE_"))}
    results: dict[str, Any] = {}
    samples: dict[str, list[Sample]] = {k: [] for k in MODES}
    events = []
    fast = subprocess.run([LAUNCHER, "--install-fast", str(work)], capture_output=True, text=True,
                          check=True).stdout.strip()
    server = None
    agent_env = None
    try:
        for i in range(args.runs):  # interleaved rounds: a busy machine drifts less between modes
            samples["none"].append(build(checkout, base, None, args.jobs))
            env = dict(base, CCACHE_DIR=str(work / f"ccache-{i}"))
            samples["ccache cold"].append(build(checkout, env, "ccache", args.jobs))
            samples["ccache warm"].append(build(checkout, env, "ccache", args.jobs))
            # (a) fresh server, no agent running: the cold build also starts the agent
            server, address = start_server(work / f"server-{i}-a")
            agent_env = launcher_env(base, address, work, f"{i}-a")
            samples["buildvault cold, agent start"].append(measured(checkout, agent_env, LAUNCHER, args.jobs, server))
            stop(agent_env, server)
            # (b) fresh server, agent already up (the usual case: it outlives builds)
            server, address = start_server(work / f"server-{i}")
            agent_env = launcher_env(base, address, work, str(i))
            prime(agent_env, work)
            for mode, launcher in (("buildvault cold", LAUNCHER), ("buildvault warm", LAUNCHER),
                                   ("buildvault warm -IS", fast)):
                samples[mode].append(measured(checkout, agent_env, launcher, args.jobs, server))
            summary = subprocess.run([LAUNCHER, "--summary", "--json", agent_env["BUILDVAULT_EVENT_LOG"]],
                                     capture_output=True, text=True, check=True).stdout
            events.append(json.loads(summary))
            stop(agent_env, server)
            server = None
    finally:
        if agent_env:
            subprocess.run([LAUNCHER, "--stop-agent"], env=agent_env, capture_output=True)
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        shutil.rmtree(work, ignore_errors=True)
    for mode in MODES:
        results[mode] = median(samples[mode])
        if mode.startswith("buildvault"):
            results[mode]["server_cpu"] = round(statistics.median(s[3] for s in samples[mode]), 3)
    results["events"] = events
    def ratio(mode: str, base: str, field: str, digits: int) -> float:
        return round(float(results[mode][field]) / float(results[base][field]), digits)

    ratios = {
        "warm / ccache warm (total)": ratio("buildvault warm", "ccache warm", "total", 2),
        "warm / ccache warm (build step)": ratio("buildvault warm", "ccache warm", "build", 2),
        "warm -IS / ccache warm (total)": ratio("buildvault warm -IS", "ccache warm", "total", 2),
        "warm -IS / ccache warm (build step)": ratio("buildvault warm -IS", "ccache warm", "build", 2),
        "cold / none (total)": ratio("buildvault cold", "none", "total", 3),
        "cold / none (best total)": ratio("buildvault cold", "none", "best", 3),
        "warm / ccache warm (best total)": ratio("buildvault warm", "ccache warm", "best", 2),
        "cold / none (build step)": ratio("buildvault cold", "none", "build", 3),
        "cold / none (CPU, client side)": ratio("buildvault cold", "none", "cpu", 3),
        "cold incl. agent start / none (total)": ratio("buildvault cold, agent start", "none", "total", 3),
    }
    results["ratios"] = ratios
    for name in MODES:
        r = results[name]
        server_cpu = f"  (+ server CPU {r['server_cpu']:.2f} s)" if "server_cpu" in r else ""
        print(f"{name:29s} total {r['total']:6.2f} s (best {r['best']:5.2f})  build step {r['build']:6.2f} s  "
              f"CPU {r['cpu']:6.2f} s{server_cpu}")
    for name, value in ratios.items():
        print(f"{name:34s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
