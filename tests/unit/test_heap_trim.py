"""The heap trimmer (server/heap_trim.py): freed heap pages go back to the kernel, garbage in
reference cycles is collected once when the server goes quiet after a burst, and the App runs it."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import weakref

from buildvault.config import Settings
from buildvault.server.app import App
from buildvault.server.heap_trim import HeapTrimmer
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore

BLOCK = 64 << 10  # under glibc's mmap threshold: these come from the heap, not from their own mapping
BLOCKS = 1600  # 100 MiB


def anonymous_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


async def test_freed_heap_memory_goes_back_to_the_kernel():
    blocks = [b"\x01" * BLOCK for _ in range(BLOCKS)]
    kept = blocks[-1]  # the newest block pins the top of the heap: glibc's own trim cannot release below it
    del blocks
    freed_but_resident = anonymous_kib()
    trimmer = HeapTrimmer(interval=0.01)
    trimmer.start()
    try:
        while trimmer.trims == 0:
            await asyncio.sleep(0.01)
    finally:
        await trimmer.stop()
    released_mib = (freed_but_resident - anonymous_kib()) / 1024
    assert released_mib > 50, f"only {released_mib:.1f} MiB of the 100 MiB freed went back"
    assert len(kept) == BLOCK


class Cycle:
    """An object only the cyclic garbage collector can free."""

    def __init__(self) -> None:
        self.me = self


class CpuClock:
    """The process CPU time the trimmer reads: each reading adds `step` (a busy process), and the
    test may add more."""

    def __init__(self, step: float = 0.0) -> None:
        self.seconds = 0.0
        self.step = step

    def __call__(self) -> float:
        self.seconds += self.step
        return self.seconds


async def ticks(trimmer: HeapTrimmer, count: int) -> None:
    """Wait until the trimmer has completed `count` more intervals."""
    target = trimmer.trims + count
    while trimmer.trims < target:
        await asyncio.sleep(0.005)


async def test_a_quiet_interval_after_a_busy_one_collects_cycles_once(no_cyclic_gc: None):
    clock = CpuClock()
    trimmer = HeapTrimmer(interval=0.01, cpu_clock=clock)
    try:
        cycle = Cycle()
        freed = weakref.ref(cycle)
        del cycle
        trimmer.start()
        await ticks(trimmer, 3)
        assert trimmer.collections == 0, "a server quiet since it started has nothing to collect"
        assert freed() is not None
        clock.seconds += 5.0  # one busy interval, then quiet ones
        await ticks(trimmer, 6)
        assert freed() is None, "the quiet interval after the busy one did not collect the cycle"
        assert trimmer.collections == 1, "one collection per quiet spell, not one per quiet interval"
        clock.seconds += 5.0
        await ticks(trimmer, 6)
        assert trimmer.collections == 2
    finally:
        await trimmer.stop()


async def test_a_busy_server_never_collects():
    trimmer = HeapTrimmer(interval=0.01, cpu_clock=CpuClock(step=1.0))  # a second of CPU between readings
    trimmer.start()
    try:
        await ticks(trimmer, 8)
        assert trimmer.collections == 0
    finally:
        await trimmer.stop()


async def test_the_app_runs_the_trimmer_while_it_serves(tmp_path):
    settings = Settings(dir=tmp_path / "data", grpc_address="127.0.0.1:0", http_address="")
    app = App(settings, blobs=MemoryBlobStore(), actions=MemoryActionStore())
    await app.start()
    try:
        assert app.heap_trimmer.running
    finally:
        await app.stop(grace=0)
    assert not app.heap_trimmer.running


# Eight threads alive at once, each allocating from the C heap, then glibc's own count of arenas
# (malloc_stats() prints one "Arena N:" block per arena to stderr).
_ARENAS_PROBE = """
import ctypes, sys, threading
from buildvault.server.heap_trim import limit_arenas
if sys.argv[1] == "limit":
    assert limit_arenas()
barrier = threading.Barrier(8)
def work():
    held = [bytearray(64 << 10) for _ in range(4)]  # above pymalloc's small objects: malloc's heap
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(None).malloc_stats()
"""


def _arenas(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    probe = [sys.executable, "-c", _ARENAS_PROBE, mode]
    done = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return len(re.findall(r"^Arena \d+:", done.stderr, re.M))


def test_limit_arenas_caps_the_arenas_of_threads_started_after_it():
    assert _arenas("default") > 2  # glibc's default gives new threads arenas of their own
    assert _arenas("limit") <= 2


# A stream of 1 MiB buffers, eight alive at once (like received pieces and write batches), then
# the minor page faults of the same stream once warm: each is memory given back and touched again.
_CHURN_PROBE = """
import collections, os, resource, sys
from buildvault.server.heap_trim import reuse_large_blocks
if sys.argv[1] == "reuse":
    assert reuse_large_blocks()
held = collections.deque()
def churn(count):
    for i in range(count):
        held.append(os.urandom((1 << 20) - i % 7 * 4096))
        if len(held) > 8:
            held.popleft()
churn(64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(256)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _churn_faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    done = subprocess.run(
        [sys.executable, "-c", _CHURN_PROBE, mode], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_reused_large_blocks_are_not_given_back_and_faulted_in_again():
    assert _churn_faults("default") > 2000  # glibc's adaptive thresholds: 256 MiB churned, thousands of faults
    assert _churn_faults("reuse") < 200
