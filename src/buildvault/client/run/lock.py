"""One lock per step key on this machine, so identical concurrent steps run the command once.

The lock is an flock on a file in the agent directory (private to the user): the kernel drops
it when its holder exits, so a killed step never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
import time

from ..protocol import agent_dir

# How often a waiting step tries the lock again: flock has no timeout of its own.
_RETRY_SECONDS = 0.01


class KeyLock:
    def __init__(self, key_hash: str, directory: str | None = None):
        base = directory or os.path.join(agent_dir(), "run-locks")
        self.path = os.path.join(base, f"{key_hash}.lock")
        self._fd: int | None = None

    def acquire(self, timeout: float) -> bool:
        """True once held; False if another holder kept it for `timeout` seconds."""
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + timeout
        delay = _RETRY_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 1.5, 0.2)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
