"""Drive `buildvault run` as a real subprocess against a live server, and count real runs.

The step scripts append one line to $RUN_LOG each time they really run (RUN_LOG is not part
of any key), so a test knows exactly which steps ran and which came from the cache.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from buildvault.client import protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
from server_process import ServerProcess  # type: ignore[import-not-found]  # tests/integration, on sys.path above

__all__ = [
    "BUILDVAULT",
    "OPERATOR_STEP",
    "STATUS",
    "ServerProcess",
    "require_buildvault",
    "Step",
    "run_step",
    "runs",
    "start_step",
    "step_env",
    "stop_agent_at",
    "tree_bytes",
]

BUILDVAULT = Path(sys.executable).parent / "buildvault"
STATUS = re.compile(r"^\[buildvault\] (HIT|MISS|SAVED|BYPASS) step=(\S+) key=(\S+)", re.M)

OPERATOR_STEP = """#!/bin/sh
# A stand-in for a generated operator build script: several outputs and a symlink.
set -e
echo "$1" >> "$RUN_LOG"
mkdir -p "$2"
tr a-z A-Z < "$1" > "$2/kernel.o"
printf '{"source": "%s", "soc": "%s", "mode": "%s"}\\n' "$(basename "$1")" "$SOC" "$OP_MODE" > "$2/meta.json"
cp "$1" "$2/source.copy"
ln -sf kernel.o "$2/kernel.link"
echo "compiled $(basename "$1")"
echo "note: fake ascend compiler" >&2
"""


def require_buildvault() -> Path:
    if not BUILDVAULT.exists():
        raise RuntimeError(f"{BUILDVAULT} is missing: run `{sys.executable} -m pip install -e .`")
    return BUILDVAULT


@dataclass
class Step:
    code: int
    stdout: str
    stderr: str

    @property
    def status(self) -> str:
        found = STATUS.findall(self.stdout)
        assert len(found) == 1, f"want one status line, got {found}:\n{self.stdout}\n{self.stderr}"
        return str(found[0][0])

    @property
    def key(self) -> str:
        return str(STATUS.findall(self.stdout)[0][2])


def step_env(server: ServerProcess | None, agent_dir: Path, run_log: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUILDVAULT_")}
    if server is not None:
        env["BUILDVAULT_REMOTE"] = f"grpc://{server.grpc_address}"
    env.update(BUILDVAULT_WRITER="1", BUILDVAULT_AGENT_DIR=str(agent_dir), RUN_LOG=str(run_log), BUILDVAULT_TIMEOUT="3")
    env.update(extra)
    return env


def run_step(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> Step:
    proc = subprocess.run(
        [str(require_buildvault()), "run", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    return Step(proc.returncode, proc.stdout, proc.stderr)


def start_step(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(require_buildvault()), "run", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop_agent_at(sock_path: Path) -> None:
    """Ask the agent listening on `sock_path` to stop, and wait until it has let the socket go."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(sock_path))
        protocol.send(s, {"op": "stop"})
        protocol.recv(s)


def runs(run_log: Path) -> list[str]:
    """Lines the step scripts logged since the last call (one per real run), then empty the log."""
    if not run_log.exists():
        return []
    lines = run_log.read_text().splitlines()
    run_log.write_text("")
    return lines


def tree_bytes(root: Path) -> dict[str, bytes | str]:
    """{relative path: file bytes, or 'link->target' for a symlink} of everything under root."""
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link->" + os.readlink(path)
        elif path.is_file():
            out[rel] = path.read_bytes()
    return out
