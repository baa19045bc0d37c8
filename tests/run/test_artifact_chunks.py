"""`buildvault artifact` sends and fetches large files as the chunks that changed (SplitBlob /
SpliceBlob): counted by the server's own /metrics, and by what the client asked of it."""

from __future__ import annotations

import random
import re
import subprocess
import urllib.request
from pathlib import Path

from run_harness import BUILDVAULT, ServerProcess, require_buildvault, step_env, tree_bytes

OPERATORS = 40
OBJECT_SIZE = 512 * 1024  # a 20 MiB archive: a size where one changed member is a small part


def artifact(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    require_buildvault()
    return subprocess.run([str(BUILDVAULT), "artifact", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def build_output(root: Path, version: int, changed: int | None) -> int:
    """A csrc-like build output: one object per operator and the static library of all of them
    (an `ar` archive: a header and the member's bytes each). Operator `changed` differs by version."""
    out = root / "output"
    (out / "obj").mkdir(parents=True, exist_ok=True)
    archive = bytearray(b"!<arch>\n")
    for op in range(OPERATORS):
        seed = op * 1000 + (version if op == changed else 0)
        data = random.Random(seed).randbytes(OBJECT_SIZE)
        (out / "obj" / f"op{op:02d}.o").write_bytes(data)
        archive += f"op{op:02d}.o/{' ' * 10}{len(data):<10}`\n".encode() + data
    (out / "libops.a").write_bytes(bytes(archive))
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def server_bytes(server: ServerProcess, name: str) -> float:
    """A counter summed over its labels, from the server's /metrics."""
    with urllib.request.urlopen(f"http://{server.http_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(v) for v in re.findall(rf"^buildvault_{name}_total{{[^}}]*}} (\S+)$", text, re.M))


def test_a_second_push_and_pull_move_only_what_changed(server: ServerProcess, tmp_path: Path) -> None:
    env = step_env(server, tmp_path / "agent", tmp_path / "runs.log", BUILDVAULT_CHUNK_CACHE=str(tmp_path / "chunks"))
    size = build_output(tmp_path, 1, None)
    assert (tmp_path / "output" / "libops.a").stat().st_size > 6 << 20  # above the chunking threshold
    received = server_bytes(server, "cas_written_bytes")
    assert artifact(["push", "l0", "--key-value", "v=1", "output"], tmp_path, env).returncode == 0
    first = server_bytes(server, "cas_written_bytes") - received
    assert first >= size  # everything was new

    build_output(tmp_path, 2, changed=7)  # one operator's sources changed
    before = server_bytes(server, "cas_written_bytes")
    pushed = artifact(["push", "l0", "--key-value", "v=2", "output"], tmp_path, env)
    assert pushed.returncode == 0, pushed.stderr
    second = server_bytes(server, "cas_written_bytes") - before
    print(f"artifact {size} bytes; first push sent {first:.0f}, second {second:.0f} ({second / size:.3f})")
    assert second <= 0.15 * size

    # Another machine: pulling version 1 fills its chunk cache; version 2 then downloads only what changed.
    env = dict(env, BUILDVAULT_CHUNK_CACHE=str(tmp_path / "other-machine-chunks"))
    sent = server_bytes(server, "cas_read_bytes")
    assert artifact(["pull", "l0", "--key-value", "v=1", "--dest", "v1"], tmp_path, env).returncode == 0
    assert server_bytes(server, "cas_read_bytes") - sent >= size
    sent = server_bytes(server, "cas_read_bytes")
    pulled = artifact(["pull", "l0", "--key-value", "v=2", "--dest", "v2"], tmp_path, env)
    assert pulled.returncode == 0, pulled.stderr
    fetched = server_bytes(server, "cas_read_bytes") - sent
    print(f"second pull fetched {fetched:.0f} bytes ({fetched / size:.3f})")
    assert fetched <= 0.15 * size
    assert tree_bytes(tmp_path / "v2" / "output") == tree_bytes(tmp_path / "output")


def test_against_a_server_without_chunking_pushes_and_pulls_whole(server_factory, tmp_path: Path) -> None:
    server = server_factory(extra_args=["--chunking", "false"])
    env = step_env(server, tmp_path / "agent", tmp_path / "runs.log", BUILDVAULT_CHUNK_CACHE=str(tmp_path / "chunks"))
    size = build_output(tmp_path, 1, None)
    assert artifact(["push", "l0", "--key-value", "v=1", "output"], tmp_path, env).returncode == 0
    build_output(tmp_path, 2, changed=3)
    before = server_bytes(server, "cas_written_bytes")
    assert artifact(["push", "l0", "--key-value", "v=2", "output"], tmp_path, env).returncode == 0
    # The whole archive again: no server-side splicing to lean on.
    assert server_bytes(server, "cas_written_bytes") - before >= size / 2
    pulled = artifact(["pull", "l0", "--key-value", "v=2", "--dest", "v2"], tmp_path, env)
    assert pulled.returncode == 0, pulled.stderr
    assert tree_bytes(tmp_path / "v2" / "output") == tree_bytes(tmp_path / "output")
