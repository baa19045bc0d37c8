"""Hit overhead of `buildvault run`: a step with 20 inputs and 5 outputs, restored from the cache.

    python bench/run_bench.py [--repeat 40] [--json]

Starts its own buildvault server on loopback, stores the step once (SAVED), then times
`--repeat` hits with the outputs deleted before each (so every hit restores all 5): the wall
time of the whole `buildvault run` process, first through the local agent (the default: the
front imports no grpc, the agent keys, looks up and restores), then with BUILDVAULT_RUN_AGENT=0
(start-up, gRPC imports, key, lookup, restore in the process). Also times
`python -c pass`, `buildvault --help` and the imports of the hit path (grpc, protobuf) alone,
and the same hits inside this process (no start-up, imports loaded), to show how much of a hit
is start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import start_buildvault, stop

BUILDVAULT = Path(sys.executable).parent / "buildvault"
STEP = """#!/bin/sh
mkdir -p out
for i in 1 2 3 4 5; do cat src/*.h > out/o$i.bin; echo $i >> out/o$i.bin; done
"""


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return took, proc.stdout


def hits_in_process(run_args: list[str], step: Path, env: dict[str, str], repeat: int) -> list[float]:
    """The same hits run inside this (already started, imports loaded) process: what a hit costs
    without interpreter start-up and imports (key, lookup, restore; a new channel each time)."""
    import contextlib
    import io

    from buildvault.client.run.command import run_main

    took = []
    here = os.getcwd()
    saved = dict(os.environ)
    os.environ.update(env)
    os.chdir(step)
    try:
        for _ in range(repeat):
            shutil.rmtree(step / "out")
            out = io.StringIO()
            start = time.perf_counter()
            with contextlib.redirect_stdout(out):
                code = run_main(run_args)
            took.append(time.perf_counter() - start)
            assert code == 0 and "[buildvault] HIT" in out.getvalue(), out.getvalue()
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)
    return took


def stop_agents(agent_dir: Path) -> None:
    import socket

    from buildvault.client import protocol

    for path in agent_dir.glob("agent-*.sock"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            try:
                s.connect(str(path))
                protocol.send(s, {"op": "stop"})
                protocol.recv(s)
            except OSError:
                pass


def timed_hits(argv: list[str], step: Path, env: dict[str, str], repeat: int) -> list[float]:
    hits = []
    for _ in range(repeat):
        shutil.rmtree(step / "out")
        took, out = timed(argv, step, env)
        assert "[buildvault] HIT" in out, out
        hits.append(took)
    return hits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="run-bench-"))
    server = start_buildvault(work / "data", work / "server.log")
    try:
        step = work / "step"
        (step / "src").mkdir(parents=True)
        for i in range(19):
            (step / "src" / f"h{i:02d}.h").write_text(f"// header {i}\n" + "int x;\n" * 200)
        (step / "step.sh").write_text(STEP)
        (step / "step.sh").chmod(0o755)  # input 20: the recipe file
        # As in a checkout, the inputs are older than the 2 s racy window (files changed within it
        # are hashed again on every step, so freshly written ones would time the hashing instead).
        old = time.time() - 3600
        for path in [*(step / "src").iterdir(), step / "step.sh"]:
            os.utime(path, (old, old))
        env = {
            **os.environ,
            "BUILDVAULT_REMOTE": f"grpc://{server.address}",
            "BUILDVAULT_WRITER": "1",
            "BUILDVAULT_AGENT_DIR": str(work / "agent"),
        }
        argv = [
            str(BUILDVAULT),
            "run",
            "--input",
            "src",
            "--recipe-file",
            "step.sh",
            *[a for i in range(1, 6) for a in ("--output", f"out/o{i}.bin")],
            "--",
            "./step.sh",
        ]
        _, first = timed(argv, step, env)
        assert "SAVED" in first, first
        timed_hits(argv, step, env, 1)  # the first hit may start the agent
        hits = timed_hits(argv, step, env, args.repeat)
        # buildvault-run-fast: what buildvault.cmake starts (python -IS, no site-packages start-up)
        fast = subprocess.run(
            [str(BUILDVAULT), "run", "--install-fast", str(work / "bin")], capture_output=True, text=True, check=True
        ).stdout.strip()
        fast_hits = timed_hits([fast, *argv[2:]], step, env, args.repeat)
        no_agent = {**env, "BUILDVAULT_RUN_AGENT": "0"}
        cli_in_process = timed_hits(argv, step, no_agent, args.repeat)
        in_process = hits_in_process(argv[2:], step, no_agent, args.repeat)
        python = [timed([sys.executable, "-c", "pass"], step, env)[0] for _ in range(10)]
        cli = [timed([str(BUILDVAULT), "--help"], step, env)[0] for _ in range(10)]
        imports = [timed([sys.executable, "-c", "import buildvault.client.run.step"], step, env)[0] for _ in range(10)]
        front = [
            timed(
                [sys.executable, "-c", "import buildvault.client.run.command, buildvault.client.run.fast"], step, env
            )[0]
            for _ in range(10)
        ]
        load = os.getloadavg()[0]
        row = {
            "inputs": 20,
            "outputs": 5,
            "repeat": args.repeat,
            "hit_p50_ms": round(statistics.median(hits) * 1000, 1),
            "hit_p95_ms": round(percentile(hits, 95) * 1000, 1),
            "fast_script_hit_p50_ms": round(statistics.median(fast_hits) * 1000, 1),
            "fast_script_hit_p95_ms": round(percentile(fast_hits, 95) * 1000, 1),
            "no_agent_hit_p50_ms": round(statistics.median(cli_in_process) * 1000, 1),
            "no_agent_hit_p95_ms": round(percentile(cli_in_process, 95) * 1000, 1),
            "in_process_hit_p50_ms": round(statistics.median(in_process) * 1000, 1),
            "in_process_hit_p95_ms": round(percentile(in_process, 95) * 1000, 1),
            "python_startup_p50_ms": round(statistics.median(python) * 1000, 1),
            "buildvault_help_p50_ms": round(statistics.median(cli) * 1000, 1),
            "python_plus_step_imports_p50_ms": round(statistics.median(imports) * 1000, 1),
            "python_plus_front_imports_p50_ms": round(statistics.median(front) * 1000, 1),
            "load_1min": round(load, 2),
            "cpus": os.cpu_count(),
        }
    finally:
        stop_agents(work / "agent")
        stop(server)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(row))
    else:
        for k, v in row.items():
            print(f"{k:32} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
