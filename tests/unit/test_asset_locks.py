"""assets/locks.py: one holder of a download's lock across processes; a holder that dies
releases it; a waiter that gives up leaves nothing held; the lock file goes with its holder."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from buildvault.assets.locks import LOCK_PREFIX, DownloadLocks

NAME = "ab" * 32
HOLD = textwrap.dedent(
    """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.read()
    """
)


async def _not_within(event: asyncio.Event, seconds: float) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


async def _enter(locks: DownloadLocks, entered: asyncio.Event, leave: asyncio.Event) -> None:
    async with locks.hold(NAME):
        entered.set()
        await leave.wait()


async def test_a_lock_held_by_a_process_that_dies_is_released(tmp_path: Path) -> None:
    path = tmp_path / f"{LOCK_PREFIX}{NAME}"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        assert await asyncio.to_thread(holder.stdout.readline) == b"held\n"
        entered, leave = asyncio.Event(), asyncio.Event()
        waiter = asyncio.create_task(_enter(DownloadLocks(tmp_path), entered, leave))
        await _not_within(entered, 0.3)
        holder.send_signal(signal.SIGKILL)  # no unlock: the kernel releases it with the process
        await asyncio.wait_for(entered.wait(), 10)
        leave.set()
        await waiter
    finally:
        holder.kill()
        holder.wait()
    assert not path.exists()  # the holder removed its lock file


async def test_one_holder_at_a_time_and_a_waiter_that_gives_up_holds_nothing(tmp_path: Path) -> None:
    first_in, first_out = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(_enter(DownloadLocks(tmp_path), first_in, first_out))
    await asyncio.wait_for(first_in.wait(), 10)
    # Another process's view: its own descriptors (a DownloadLocks of its own).
    gave_up_in = asyncio.Event()
    gave_up = asyncio.create_task(_enter(DownloadLocks(tmp_path), gave_up_in, asyncio.Event()))
    second_in, second_out = asyncio.Event(), asyncio.Event()
    second = asyncio.create_task(_enter(DownloadLocks(tmp_path), second_in, second_out))
    await _not_within(second_in, 0.3)
    gave_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gave_up
    first_out.set()
    await first
    await asyncio.wait_for(second_in.wait(), 10)
    assert not gave_up_in.is_set()
    second_out.set()
    await second
    third_in, third_out = asyncio.Event(), asyncio.Event()
    third = asyncio.create_task(_enter(DownloadLocks(tmp_path), third_in, third_out))
    await asyncio.wait_for(third_in.wait(), 10)  # nothing was left held
    third_out.set()
    await third
    assert list(tmp_path.iterdir()) == []
