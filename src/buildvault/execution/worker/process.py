"""Run one command: exactly its environment, its working directory, its own process group.

On timeout or cancel the whole group gets SIGTERM, then SIGKILL after a short grace, and the
call returns only once the group leader is reaped: nothing is left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

# Seconds between SIGTERM and SIGKILL.
KILL_GRACE = 2.0


class Cancel:
    """Set from any thread to stop the job's command; wakes its watcher at once."""

    def __init__(self) -> None:
        self.requested = False
        self.wake = threading.Event()

    def set(self) -> None:
        self.requested = True
        self.wake.set()


@dataclass
class Outcome:
    exit_code: int
    timed_out: bool = False
    cancelled: bool = False


def run(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    stdout: Path,
    stderr: Path,
    timeout: float,
    cancel: Cancel,
) -> Outcome:
    """Run to completion, timeout or cancel. OSError when the program cannot be started."""
    if cancel.requested:
        return Outcome(-1, cancelled=True)
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        process = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
        )
    finished = threading.Event()
    stopped: list[str] = []

    def watch() -> None:
        # Wakes on cancel, or on the timeout; `finished` says the command ended by itself.
        cancel.wake.wait(timeout)
        if finished.is_set():
            return
        stopped.append("cancel" if cancel.requested else "timeout")
        _stop(process)

    watcher = threading.Thread(target=watch, name="action-watch", daemon=True)
    watcher.start()
    code = process.wait()
    finished.set()
    cancel.wake.set()  # release the watcher (the job is over; its Cancel is not reused)
    watcher.join()
    _kill_group(process.pid, signal.SIGKILL)  # stragglers of a leader that exited by itself
    reason = stopped[0] if stopped else ""
    return Outcome(code, timed_out=reason == "timeout", cancelled=reason == "cancel")


def _stop(process: subprocess.Popen[bytes]) -> None:
    _kill_group(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=KILL_GRACE)
    _kill_group(process.pid, signal.SIGKILL)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
