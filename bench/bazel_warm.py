"""A real-client figure: wall time of a warm Bazel build (every spawn a cache hit).

The workspace is tests/e2e/bazel_workspace plus a generated package `//gen` of N small C++
libraries in chains of 8 and one binary over all of them, so a warm build is N compiles,
2N links (.a and .so) and the binary's compile and link, all answered by the cache. Each
backend gets its own workspace and Bazel server; a cold build fills its cache, then every
repetition is `bazel clean` + a timed `bazel build //...` with the backends in rotated order.
A warm build passes only if Bazel executed nothing (every cacheable spawn a hit) and the
binary it fetched prints the expected line.

    python bench/bazel_warm.py --libs 60 --reps 3     # buildvault vs --disk_cache (+ BuildGrid)
    python bench/bazel_warm.py --floor                # + a remote cache that is a dict in memory
    python bench/bazel_warm.py --cold-reps 3 --reps 1 # the cold build three times (fresh sources each)
    python bench/bazel_warm.py --chunking-ab --cold-reps 3 --reps 5   # chunking on vs --chunking false
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from bench import servers  # noqa: E402

CHAIN = 8


def expected_sum(libs: int, nonce: int) -> int:
    values: list[int] = []
    for i in range(libs):
        base = values[i - 1] if i % CHAIN else 0
        values.append(base + 1 + i + nonce)
    return sum(values)


def make_template(template: Path, dest: Path, libs: int, nonce: int) -> None:
    """Copy the e2e workspace and add //gen: fresh sources every run (the nonce)."""
    shutil.copytree(template, dest, symlinks=True)
    gen = dest / "gen"
    gen.mkdir()
    build = []
    for i in range(libs):
        dep = i - 1 if i % CHAIN else None
        (gen / f"l{i}.h").write_text(f"#pragma once\n#include <string>\nint f{i}(int x);\nstd::string name{i}();\n")
        include_dep = f'#include "gen/l{dep}.h"\n' if dep is not None else ""
        base = f"f{dep}(x)" if dep is not None else "0"
        (gen / f"l{i}.cc").write_text(
            f'#include "gen/l{i}.h"\n{include_dep}#include <vector>\n#include <algorithm>\n\n'
            f"int f{i}(int x) {{ return {base} + x + {i} + {nonce}; }}\n"
            f"std::string name{i}() {{\n"
            f'  std::vector<std::string> parts{{"lib", "{i}", "{nonce}"}};\n'
            f"  std::sort(parts.begin(), parts.end());\n"
            f'  std::string out; for (const auto& p : parts) out += p; return out;\n}}\n'
        )
        deps = f', deps = [":l{dep}"]' if dep is not None else ""
        build.append(f'cc_library(name = "l{i}", srcs = ["l{i}.cc"], hdrs = ["l{i}.h"]{deps})')
    includes = "".join(f'#include "gen/l{i}.h"\n' for i in range(libs))
    calls = " + ".join(f"(long long)f{i}(1)" for i in range(libs))
    (gen / "main.cc").write_text(
        f"#include <cstdio>\n{includes}\nint main() {{\n  long long sum = {calls};\n"
        f'  std::printf("bench-gen: libs={libs} sum=%lld\\n", sum);\n  return 0;\n}}\n'
    )
    all_deps = ", ".join(f'":l{i}"' for i in range(libs))
    build.append(f'cc_binary(name = "all", srcs = ["main.cc"], deps = [{all_deps}])')
    (gen / "BUILD").write_text("\n".join(build) + "\n")


def run(
    backends: dict[str, dict[str, Any]], workdir: Path, libs: int = 60, reps: int = 3, log=print, cold_reps: int = 1
) -> dict[str, Any]:
    """backends: name -> {"remote_cache": "grpc://..."} or {"disk_cache": Path}. Returns the figures.

    Each of `cold_reps` cold rounds builds fresh sources (a new nonce) in fresh workspaces with
    `--action_env=BENCH_ROUND=N`, so every action is new to every cache (the workspace's own
    targets do not see the nonce), the backends in rotated order; the warm builds use the last
    round's."""
    from bazel_harness import BazelWorkspace  # tests/e2e: real Bazel driver

    names = list(backends)
    figures: dict[str, Any] = {name: {"warm_s": [], "cold_runs_s": []} for name in names}
    workspaces: dict[str, Any] = {}
    try:
        spawns = None
        round_flag = ""
        for cold_rep in range(cold_reps):
            round_flag = f"--action_env=BENCH_ROUND={cold_rep}"
            for ws in workspaces.values():
                ws.shutdown()
            nonce = int.from_bytes(os.urandom(3), "big") % 100000
            template = workdir / f"template-{cold_rep}"
            make_template(servers.ROOT / "tests" / "e2e" / "bazel_workspace", template, libs, nonce)
            want_line = f"bench-gen: libs={libs} sum={expected_sum(libs, nonce)}"
            workspaces = {
                name: BazelWorkspace(workdir / f"{cold_rep}-{name.replace('/', '_')}", template=template)
                for name in names
            }
            for name in names[cold_rep % len(names) :] + names[: cold_rep % len(names)]:
                start = time.perf_counter()
                result = workspaces[name].build(round_flag, **backends[name])
                elapsed = time.perf_counter() - start
                result.check()
                figures[name]["cold_runs_s"].append(elapsed)
                executed = result.processes.executed if result.processes else None
                processes = result.processes.line if result.processes else "?"
                log(f"bazel cold build {cold_rep + 1}/{cold_reps} via {name}: {elapsed:.1f} s, {processes}")
                if spawns is None:
                    spawns = executed
                elif executed != spawns:
                    raise AssertionError(f"cold build via {name} executed {executed} spawns, expected {spawns}")
        for rep in range(reps):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                ws = workspaces[name]
                ws.clean()
                start = time.perf_counter()
                result = ws.build(round_flag, **backends[name])
                elapsed = time.perf_counter() - start
                result.check()
                summary = result.processes
                if summary is None or summary.executed != 0 or summary.cache_hits != spawns:
                    raise AssertionError(
                        f"warm build via {name} was not all cache hits ({spawns} expected): "
                        f"{summary.line if summary else result.output[-2000:]}"
                    )
                got = ws.run_binary("gen/all").stdout.strip()
                if got != want_line:
                    raise AssertionError(f"binary built via {name} printed {got!r}, expected {want_line!r}")
                figures[name]["warm_s"].append(elapsed)
                log(f"bazel warm build {rep + 1}/{reps} via {name}: {elapsed:.2f} s ({summary.line})")
    finally:
        for ws in workspaces.values():
            with contextlib.suppress(Exception):
                ws.shutdown()
    for name in names:
        warm, cold = figures[name]["warm_s"], figures[name]["cold_runs_s"]
        figures[name]["warm_median_s"] = statistics.median(warm) if warm else None
        figures[name]["cold_s"] = statistics.median(cold) if cold else None  # the median cold build
    return {"libs": libs, "cacheable_spawns": spawns, "reps": reps, "backends": figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libs", type=int, default=60)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cold-reps", type=int, default=1, help="cold builds per backend, each of fresh sources")
    parser.add_argument("--buildgrid", action="store_true", help="also time the build through BuildGrid")
    parser.add_argument("--chunking-ab", action="store_true",
                        help="buildvault with chunking (the default) vs --chunking false; no --disk_cache")  # fmt: skip
    parser.add_argument("--floor", action="store_true",
                        help="also via bench/floor_server.py (grpc.aio, a dict in memory): the floor")  # fmt: skip
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="buildvault-bazel-warm-"))
    started: list[servers.Server] = []
    try:
        bv = servers.start_buildvault(workdir / "bv-data", workdir / "bv.log")
        started.append(bv)
        backends: dict[str, dict[str, Any]] = {"buildvault": {"remote_cache": f"grpc://{bv.address}"}}
        if args.chunking_ab:
            whole = servers.start_buildvault(
                workdir / "bv-whole-data", workdir / "bv-whole.log", ["--chunking", "false"]
            )
            started.append(whole)
            backends["buildvault-chunking-false"] = {"remote_cache": f"grpc://{whole.address}"}
        else:
            backends["disk_cache"] = {"disk_cache": workdir / "disk-cache"}
        if args.buildgrid:
            bg = servers.start_buildgrid(workdir / "bg-data", workdir / "bg.log")
            started.append(bg)
            backends["buildgrid"] = {"remote_cache": f"grpc://{bg.address}"}
        if args.floor:
            floor = servers.start_floor("aio", workdir / "floor.log")
            started.append(floor)
            backends["floor-aio"] = {"remote_cache": f"grpc://{floor.address}"}
        figures = run(
            backends, workdir, args.libs, args.reps, log=lambda m: print(m, file=sys.stderr), cold_reps=args.cold_reps
        )
        print(json.dumps(figures, indent=1, default=str))
        return 0
    finally:
        for server in started:
            servers.stop(server)
        servers.remove(workdir)


if __name__ == "__main__":
    sys.exit(main())
