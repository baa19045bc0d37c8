"""How an action's command is wrapped: bubblewrap, or nothing but its own process group.

`bwrap`: the host filesystem read-only (actions call host tools such as /usr/bin/gcc by absolute
path and read system headers they do not list as inputs), a fresh /tmp, /dev and /proc, only the
action directory writable, no network, a pid namespace, and `--die-with-parent` so nothing
outlives the worker. `auto` uses bubblewrap when a probe run works and otherwise falls back to a
plain process group, saying so once in the log.
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger("buildvault.worker")


class SandboxError(RuntimeError):
    """`bwrap` was asked for and cannot run here."""


@functools.cache
def bwrap_works() -> str | None:
    """None when bubblewrap runs here, else why not."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bwrap is not installed (Debian package bubblewrap)"
    try:
        probe = subprocess.run(
            [exe, "--ro-bind", "/", "/", "--unshare-net", "--unshare-pid", "--die-with-parent", "true"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap probe failed: {e}"
    if probe.returncode != 0:
        return f"bwrap probe failed: {probe.stderr.decode(errors='replace').strip()}"
    return None


def choose(mode: str) -> str:
    """The sandbox actually used for `mode` (auto|bwrap|none): 'bwrap' or 'none'."""
    if mode == "none":
        return "none"
    problem = bwrap_works()
    if problem is None:
        return "bwrap"
    if mode == "bwrap":
        raise SandboxError(problem)
    log.warning("sandbox auto: %s; actions run in a plain process group", problem)
    return "none"


def wrap(kind: str, argv: list[str], action_dir: Path, cwd: Path, env: dict[str, str]) -> list[str]:
    """The argv that runs `argv` in `cwd` under sandbox `kind`, with exactly `env`."""
    if kind == "none":
        return argv
    # bwrap --chdir sets PWD; the action must see exactly its Command's environment.
    pwd = ["--", "PWD=" + env["PWD"]] if "PWD" in env else ["-u", "PWD", "--"]
    bwrap = shutil.which("bwrap") or "bwrap"
    return [
        bwrap,
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--bind",
        str(action_dir),
        str(action_dir),
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--die-with-parent",
        "--chdir",
        str(cwd),
        "--",
        "/usr/bin/env",
        *pwd,
        *argv,
    ]
