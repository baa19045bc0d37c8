"""The fast path of `buildvault run`: a hit answered by buildvault-cc's agent, and the
in-process path whenever the agent is off or cannot be reached."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

from run_harness import BUILDVAULT, ServerProcess, Step, run_step, runs, tree_bytes
from test_run_step import make_env, op_args

from buildvault.client import protocol

HEAVY_MODULES = ("grpc", "google.protobuf", "asyncio")


def imported(stderr: str) -> set[str]:
    """Top-level names of the modules a `python -X importtime` process imported."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def heavy(stderr: str) -> list[str]:
    return sorted(n for n in imported(stderr) if any(n == m or n.startswith(m + ".") for m in HEAVY_MODULES))


def agent_sockets(agent_dir: Path) -> list[Path]:
    return sorted(agent_dir.glob("agent-*.sock"))


def ping(sock_path: Path) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock_path))
        protocol.send(s, {"op": "ping"})
        reply = protocol.recv(s)
    assert reply is not None and reply["op"] == "pong"
    return int(reply["pid"])


def test_hit_is_answered_by_the_agent_without_grpc(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    env = make_env(server, tmp_path, BUILDVAULT_EVENT_LOG=str(log))
    saved = run_step(op_args("add"), checkout, env)
    assert (saved.code, saved.status) == (0, "SAVED"), saved.stdout + saved.stderr
    before = tree_bytes(checkout / "out")
    runs(tmp_path / "runs.log")
    shutil.rmtree(checkout / "out")
    hit = run_step(op_args("add"), checkout, {**env, "PYTHONPROFILEIMPORTTIME": "1"})
    assert (hit.code, hit.status, hit.key) == (0, "HIT", saved.key), hit.stdout
    assert heavy(hit.stderr) == [], "the front imported the gRPC stack"
    assert "compiled add.cc" in hit.stdout and "note: fake ascend compiler" in hit.stderr  # replayed
    assert tree_bytes(checkout / "out") == before
    assert runs(tmp_path / "runs.log") == []
    [sock_path] = agent_sockets(tmp_path / "agent")
    assert ping(sock_path) > 0
    last = json.loads(log.read_text().splitlines()[-1])
    assert (last["status"], last["outputs"], last["action"], last["exit"]) == ("HIT", 4, saved.key, 0)


def test_agent_that_cannot_start_falls_back_in_process(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    env = make_env(server, tmp_path)
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir(mode=0o755)
    agent_dir.chmod(0o755)  # open to others: the launcher refuses to use an agent there
    assert run_step(op_args("add"), checkout, env).status == "SAVED"
    shutil.rmtree(checkout / "out")
    hit = run_step(op_args("add"), checkout, {**env, "PYTHONPROFILEIMPORTTIME": "1"})
    assert (hit.code, hit.status) == (0, "HIT"), hit.stdout + hit.stderr
    assert "grpc" in imported(hit.stderr)  # answered in-process
    assert (checkout / "out" / "add" / "kernel.o").is_file()
    assert agent_sockets(agent_dir) == []
    assert runs(tmp_path / "runs.log") == ["ops/add.cc"]


def test_run_agent_off_keeps_every_step_in_process(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    env = make_env(server, tmp_path, BUILDVAULT_RUN_AGENT="0")
    assert run_step(op_args("mul"), checkout, env).status == "SAVED"
    shutil.rmtree(checkout / "out")
    hit = run_step(op_args("mul"), checkout, {**env, "PYTHONPROFILEIMPORTTIME": "1"})
    assert (hit.code, hit.status) == (0, "HIT")
    assert "grpc" in imported(hit.stderr)
    assert agent_sockets(tmp_path / "agent") == []


def test_remote_flag_other_than_the_environment_is_served_in_process(
    server: ServerProcess,
    checkout: Path,
    tmp_path: Path,
) -> None:
    env = make_env(server, tmp_path)
    remote = env.pop("BUILDVAULT_REMOTE")
    args = op_args("add", "--remote", remote)
    assert run_step(args, checkout, env).status == "SAVED"
    shutil.rmtree(checkout / "out")
    hit = run_step(args, checkout, {**env, "PYTHONPROFILEIMPORTTIME": "1"})
    assert (hit.code, hit.status) == (0, "HIT")
    assert "grpc" in imported(hit.stderr)  # the agent's remote is the environment's, not this one


def test_the_python_IS_front_hits_without_site_and_misses_through_it(
    server: ServerProcess, checkout: Path, tmp_path: Path
) -> None:
    """buildvault-run-fast (what buildvault.cmake starts): python -IS, so no site-packages start-up;
    a hit needs only the standard library, and a miss enters site-packages for the gRPC stack."""
    written = subprocess.run(
        [str(BUILDVAULT), "run", "--install-fast", str(tmp_path / "bin")], capture_output=True, text=True, check=True
    )
    fast = Path(written.stdout.strip())
    assert fast == tmp_path / "bin" / "buildvault-run-fast" and fast.read_text().startswith("#!")
    assert fast.read_text().splitlines()[0].endswith(" -IS")
    env = make_env(server, tmp_path)

    def run_fast(args: list[str], extra: dict[str, str] | None = None) -> Step:
        proc = subprocess.run(
            [str(fast), *args], cwd=checkout, env={**env, **(extra or {})}, capture_output=True, text=True, timeout=300
        )
        return Step(proc.returncode, proc.stdout, proc.stderr)

    saved = run_fast(op_args("add"))  # a miss: the in-process path, through site.main()
    assert (saved.code, saved.status) == (0, "SAVED"), saved.stdout + saved.stderr
    assert runs(tmp_path / "runs.log") == ["ops/add.cc"]
    before = tree_bytes(checkout / "out")
    shutil.rmtree(checkout / "out")
    hit = run_fast(op_args("add"))
    assert (hit.code, hit.status, hit.key) == (0, "HIT", saved.key), hit.stdout + hit.stderr
    assert tree_bytes(checkout / "out") == before and runs(tmp_path / "runs.log") == []
