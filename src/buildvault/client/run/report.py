"""What a step shows and logs, and running its command: standard library only, so the fast
front (fast.py) can report a HIT or run a BYPASS without importing grpc or protobuf.

One status line per step goes to stdout, one JSON line to BUILDVAULT_EVENT_LOG (statuses as
buildvault-cc's: a SAVED step is a MISS with `stored`).
"""

from __future__ import annotations

import sys
import time

from .. import protocol
from .spec import StepSpec

TYPE_CHECKING = False  # no `import typing` at run time: the front starts once per step
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

PREFIX = "[buildvault]"
# Exit code of a step that could not be set up (missing input, tool, bad option).
SETUP_FAILED = 2


def warn_once(message: str) -> None:
    """One warning a minute across the steps of a build (buildvault-cc's rule)."""
    protocol.warn_once("run", message)


class Ran:
    """A command that ran: exit code (128+N for signal N), captured output, wall-clock start, seconds."""

    __slots__ = ("exit", "seconds", "started", "stderr", "stdout")

    def __init__(self, exit: int, stdout: bytes, stderr: bytes, started: float, seconds: float) -> None:
        self.exit, self.stdout, self.stderr, self.started, self.seconds = exit, stdout, stderr, started, seconds


def run_command(spec: StepSpec, env: Mapping[str, str]) -> Ran:
    """Run the step's command in its workdir with stdout/stderr captured, then echo them."""
    import subprocess  # only a step that runs pays for it

    started = time.time()
    start = time.monotonic()
    try:
        done = subprocess.run(spec.argv, cwd=spec.workdir, env=dict(env), capture_output=True, check=False)
        ran = Ran(
            done.returncode if done.returncode >= 0 else 128 - done.returncode,
            done.stdout,
            done.stderr,
            started,
            time.monotonic() - start,
        )
    except OSError as e:
        ran = Ran(127, b"", f"buildvault run: cannot run {spec.argv[0]}: {e}\n".encode(), started, 0.0)
    echo(ran.stdout, ran.stderr)
    return ran


def echo(out: bytes, err: bytes) -> None:
    if out:
        sys.stdout.flush()
        sys.stdout.buffer.write(out)
        sys.stdout.flush()
    if err:
        sys.stderr.flush()
        sys.stderr.buffer.write(err)
        sys.stderr.flush()


class StepReport:
    """The reporting half of a step: its event, its status line, and an uncached run (BYPASS)."""

    def __init__(self, spec: StepSpec, env: Mapping[str, str]):
        self.spec = spec
        self.env = env
        self.start = time.monotonic()
        self.event: dict[str, Any] = {
            "kind": "step",
            "step": spec.label,
            "status": "BYPASS",
            "reason": "",
            "action": None,
            "outputs": 0,
            "cwd": spec.workdir,
        }
        self.key_text: str | None = None  # "hash/size" of the step's Action once known
        self.ran = False  # the command has been started: never run it a second time

    @property
    def run_env(self) -> dict[str, str]:
        """The environment the command runs in: the caller's plus the step's --env values (built
        only when needed: copying the environment is measurable on the per-step hit path)."""
        return {**self.env, **dict(self.spec.env)}

    def finish(self, status: str, code: int, reason: str = "", **extra: Any) -> int:
        shown = status
        if status == "SAVED":
            status, extra["stored"] = "MISS", True
        self.event.update(
            status=status, reason=reason, exit=code, seconds=round(time.monotonic() - self.start, 4), **extra
        )
        key = self.key_text or "-"
        self.event["action"] = self.key_text
        line = f"{PREFIX} {shown} step={self.spec.label} key={key}"
        if reason and shown in ("MISS", "BYPASS"):
            line += f" reason={reason}"
        print(line, flush=True)
        if self.spec.event_log:
            import json  # only steps that log pay for it

            self.event["ts"] = round(time.time(), 3)
            protocol.append_line(self.spec.event_log, json.dumps(self.event, separators=(",", ":")) + "\n")
        return code

    def bypass(self, reason: str) -> int:
        self.ran = True
        ran = run_command(self.spec, self.run_env)
        return self.finish("BYPASS", ran.exit, reason, compile_seconds=round(ran.seconds, 4))
