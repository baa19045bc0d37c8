"""Drive real CMake builds of bazel_example/ through buildvault-cc and count real compiler runs.

The compiler CMake uses is a shim (first on PATH) that appends one line per real compile
(`-c` in its arguments) to SHIM_LOG and then execs the system g++; counting those lines is
how the tests know exactly which compiles ran and which came from the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
from server_process import ServerProcess

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "bazel_example"

THIRD_PARTY = {"csrc/third_party/tinyfmt/src/join.cc", "csrc/third_party/tinyfmt/src/shape.cc"}
OPS = {
    "attention": ["flash_attention", "paged_attention"],
    "moe": ["moe_gating", "moe_dispatch"],
    "gmm": ["grouped_matmul"],
}
ADAPTERS = {f"BUILD/generated/adapters/{op}_adapter.cc" for ops in OPS.values() for op in ops}
OP_SOURCES = {
    path
    for family, ops in OPS.items()
    for op in ops
    for path in (f"csrc/ops/{family}/{op}/op_host/{op}.cc", f"csrc/ops/{family}/{op}/op_kernel/{op}_kernel.cc")
}
SHARED = {"csrc/common/registry.cc", "csrc/common/kernel/kernel_utils.cc", "csrc/main.cc"}
ALL_COMPILES = THIRD_PARTY | OP_SOURCES | ADAPTERS | SHARED
SOC_DEPENDENT = ALL_COMPILES - THIRD_PARTY
COMPAT_INCLUDERS = ADAPTERS | {"csrc/common/kernel/kernel_utils.cc"}


def op_compiles(family: str, op: str) -> set[str]:
    """The compiles that read operator `op`'s tiling header: host, kernel, generated adapter."""
    return {
        f"csrc/ops/{family}/{op}/op_host/{op}.cc",
        f"csrc/ops/{family}/{op}/op_kernel/{op}_kernel.cc",
        f"BUILD/generated/adapters/{op}_adapter.cc",
    }


SHIM = """#!/bin/sh
# buildvault test compiler shim ({label}): log every real compile, then run g++.
if [ "$1" = "--version" ]; then
  {real} --version | sed '1s/$/ [{label}]/'
  exit 0
fi
for a in "$@"; do
  if [ "$a" = "-c" ]; then
    printf '%s\\t%s\\n' "$PWD" "$*" >> "$SHIM_LOG"
    break
  fi
done
exec {real} "$@"
"""


def generator() -> list[str]:
    """Ninja when installed (BUILDVAULT_TEST_GENERATOR overrides), else Unix Makefiles."""
    chosen = os.environ.get("BUILDVAULT_TEST_GENERATOR")
    if chosen:
        return ["-G", chosen]
    return ["-G", "Ninja"] if shutil.which("ninja") else ["-G", "Unix Makefiles"]


def launcher_command() -> str:
    exe = Path(sys.executable).parent / "buildvault-cc"
    if exe.exists():
        return str(exe)
    raise RuntimeError(f"{exe} is missing: run `{sys.executable} -m pip install -e .`")


class Toolchain:
    """A directory with the g++/c++ shims, first on PATH."""

    def __init__(self, root: Path, label: str = "v1"):
        self.dir = Path(root)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "real-compiles.log"
        self.log.touch()
        self.install(label)

    def install(self, label: str) -> None:
        real = shutil.which("g++") or "/usr/bin/g++"
        for name in ("g++", "c++"):
            path = self.dir / name
            tmp = path.with_suffix(".tmp")
            tmp.write_text(SHIM.format(real=real, label=label))
            tmp.chmod(0o755)
            os.replace(tmp, path)

    @property
    def cxx(self) -> str:
        return str(self.dir / "g++")

    def take(self) -> list[tuple[str, str]]:
        """(cwd, args) of every real compile since the last call."""
        lines = self.log.read_text().splitlines()
        self.log.write_text("")
        out = []
        for line in lines:
            cwd, _, args = line.partition("\t")
            out.append((cwd, args))
        return out


def compiled_sources(runs: list[tuple[str, str]], checkout: Path, build: Path) -> list[str]:
    """Logged compiles as tree-relative names (CMake's own try-compiles left out)."""
    out = []
    for cwd, args in runs:
        words = args.split()
        if "-c" not in words:
            continue
        src = words[words.index("-c") + 1]
        src = os.path.normpath(os.path.join(cwd, src))
        if "CMakeScratch" in src or "CMakeTmp" in src or "CMakeFiles/CMake" in src:
            continue
        b, c = str(build), str(checkout)
        if src.startswith(b + "/"):
            out.append("BUILD/" + os.path.relpath(src, b))
        elif src.startswith(c + "/"):
            out.append(os.path.relpath(src, c))
        # anything else is CMake probing the compiler (its own modules), not the tree
    return out


class Build:
    def __init__(self, checkout: Path, build: Path, returncode: int, output: str, compiled: list[str], seconds: float):
        self.checkout = checkout
        self.build = build
        self.returncode = returncode
        self.output = output
        self.compiled = compiled
        self.seconds = seconds

    @property
    def compiled_set(self) -> set[str]:
        return set(self.compiled)

    def check(self) -> Build:
        assert self.returncode == 0, self.output[-6000:]
        assert len(self.compiled) == len(self.compiled_set), f"a compile ran twice: {sorted(self.compiled)}"
        return self


def copy_checkout(dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("build", "_build", "bazel-*", "__pycache__"))
    return dest


def cmake_build(
    toolchain: Toolchain,
    checkout: Path,
    build: Path,
    env: dict[str, str],
    *,
    launcher: bool = True,
    soc: str | None = None,
    fresh: bool = True,
    jobs: int = 2,
    timeout: float = 900,
) -> Build:
    """Configure (if needed) and build; returns which compiles really ran."""
    if fresh and build.exists():
        shutil.rmtree(build)
    toolchain.take()
    run_env = dict(env)
    run_env["PATH"] = f"{toolchain.dir}{os.pathsep}{run_env.get('PATH', os.environ.get('PATH', ''))}"
    run_env["SHIM_LOG"] = str(toolchain.log)
    configure = ["cmake", "-S", str(checkout), "-B", str(build), *generator(), f"-DCMAKE_CXX_COMPILER={toolchain.cxx}"]
    if launcher:
        configure.append(f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher_command()}")
    if soc:
        configure.append(f"-DSOC={soc}")
    start = time.monotonic()
    output = []
    code = 0
    for argv in (configure, ["cmake", "--build", str(build), "--", f"-j{jobs}"]):
        proc = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=timeout)
        output.append(f"$ {' '.join(argv)}\n{proc.stdout}\n{proc.stderr}")
        if proc.returncode != 0:
            code = proc.returncode
            break
    seconds = time.monotonic() - start
    if launcher:
        flush(run_env)  # background uploads and their event-log lines are done
    compiled = compiled_sources(toolchain.take(), checkout, build)
    return Build(checkout, build, code, "\n".join(output), compiled, seconds)


def objects(build: Path) -> dict[str, bytes]:
    """Every object and dependency file under a build dir, by relative path."""
    out = {}
    for path in sorted(build.rglob("*")):
        wanted = path.name.endswith(".o") or path.name.endswith(".o.d")
        if path.is_file() and wanted and "CMakeScratch" not in str(path):
            out[str(path.relative_to(build))] = path.read_bytes()
    return out


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def flush(env: dict[str, str]) -> None:
    """Wait until the agent's background uploads (and their event lines) are done."""
    subprocess.run([launcher_command(), "--flush"], env=env, capture_output=True, timeout=180)


def stop_agent(env: dict[str, str]) -> None:
    subprocess.run([launcher_command(), "--stop-agent"], env=env, capture_output=True, timeout=30)


def start_server(root: Path, name: str = "server") -> ServerProcess:
    return ServerProcess(root / name / "data", name=name, http_address="").start()


class LauncherEnv(dict[str, str]):
    """The environment of a build through buildvault-cc (one agent per instance of this)."""

    def stop(self) -> None:
        stop_agent(self)


def make_env(server: ServerProcess | None, remote: str | None = None, writer: bool = True, **extra: str) -> LauncherEnv:
    agent_dir = tempfile.mkdtemp(prefix="bvcc-", dir="/tmp")  # unix socket paths must stay short
    env = LauncherEnv({k: v for k, v in os.environ.items() if not k.startswith("BUILDVAULT_")})
    if remote is None:
        assert server is not None, "a server or a remote URL"
        remote = f"grpc://{server.grpc_address}"
    env.update(
        BUILDVAULT_REMOTE=remote,
        BUILDVAULT_AGENT_DIR=agent_dir,
        BUILDVAULT_AGENT_IDLE="300",
        BUILDVAULT_PLATFORM="soc=ascend910b1,cann=8.0.RC3",
        BUILDVAULT_TIMEOUT="3",
    )
    if writer:
        env["BUILDVAULT_WRITER"] = "1"
    env.update(extra)
    return env
