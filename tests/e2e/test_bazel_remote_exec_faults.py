"""Faults under a real Bazel 4.2.3 remote build: a worker killed with SIGKILL mid-action (the
action reruns elsewhere, the build passes, the lost worker and the retry are counted, nothing
is left running) and the server restarted mid-action (Bazel's WaitExecution gets NOT_FOUND,
it Executes again, the build passes)."""

from __future__ import annotations

import os
import signal
import threading
import urllib.request

import pytest
from execution_client import processes_with
from polling import wait_for

pytestmark = pytest.mark.timeout(900)

SLEEP = "7.4321"  # the genrule's `sleep` argument: no other process uses it
GENRULE = f"""
genrule(
    name = "slow",
    outs = ["slow.txt"],
    cmd = "sleep {SLEEP}; echo slow-done > $@",
)
"""


def flags(server) -> tuple[str, ...]:
    return (f"--remote_executor=grpc://{server.grpc_address}", "--spawn_strategy=remote", "--noremote_local_fallback")


def running_worker_pid(server) -> int | None:
    """The pid of the local worker running the genrule, from the status page."""
    execution = server.status()["execution"]
    for worker in execution["workers"]:
        if worker["state"] == "busy" and worker["pid"]:
            return int(worker["pid"])
    return None


def metric(server, name: str) -> float:
    with urllib.request.urlopen(f"http://{server.http_address}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def build_in_background(ws, server, *extra: str):
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(r=ws.build(*flags(server), *extra, targets=("//slow:slow",))), daemon=True
    )
    thread.start()
    return thread, result


def test_worker_killed_mid_action_reruns_and_build_passes(bazel_workspace_factory, servers):
    server = servers("faults", "--local-workers", "2", log_level="debug")
    ws = bazel_workspace_factory("kill")
    ws.write_file("slow/BUILD", GENRULE)
    thread, result = build_in_background(ws, server)
    pid = wait_for(
        lambda: running_worker_pid(server) if processes_with(f"sleep {SLEEP}") else None,
        120,
        "the genrule to run on a worker",
    )
    os.kill(pid, signal.SIGKILL)
    thread.join(300)
    build = result["r"].check()
    assert build.processes["remote"] == 1, build.processes.line
    assert (ws.binary_path("slow") / "slow.txt").read_text() == "slow-done\n"
    assert metric(server, "buildvault_execution_lost_workers_total") == 1
    assert metric(server, "buildvault_execution_retries_total") == 1
    assert not processes_with(f"sleep {SLEEP}")  # the killed worker's action did not outlive it
    assert not any(w["pid"] == pid for w in server.status()["execution"]["workers"])


def test_server_restarted_mid_action_bazel_executes_again(bazel_workspace_factory, servers):
    server = servers("restart", "--local-workers", "2", log_level="debug")
    ws = bazel_workspace_factory("restart")
    ws.write_file("slow/BUILD", GENRULE)
    # Bazel's default 5 retries (about 3 s of backoff) are shorter than a restart of the server.
    thread, result = build_in_background(ws, server, "--remote_retries=12")
    wait_for(lambda: processes_with(f"sleep {SLEEP}"), 120, "the genrule to run")
    server.restart()  # same port: Bazel reconnects, its WaitExecution finds no such operation
    wait_for(lambda: not thread.is_alive(), 300, "the build to finish")
    build = result["r"].check()
    assert (ws.binary_path("slow") / "slow.txt").read_text() == "slow-done\n", build.output
    log = server.log_path.read_text().split("--- start #2")[1]
    assert '"rpc":"WaitExecution"' in log and '"code":"NOT_FOUND"' in log, log[-3000:]
    assert '"rpc":"Execute"' in log
