"""`buildvault artifact` against a live server: exact keys, git ls-files trees, misses, pins."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

from run_harness import BUILDVAULT, ServerProcess, require_buildvault, step_env, tree_bytes


def artifact(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    require_buildvault()
    return subprocess.run(
        [str(BUILDVAULT), "artifact", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def make_tree(root: Path) -> None:
    src = root / "csrc"
    (src / "ops").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    (src / "ops" / "op.cc").write_text("int op() { return 1; }\n")
    (src / ".gitignore").write_text("*.o\n")
    subprocess.run(["git", "-C", str(src), "add", "."], check=True)
    (src / "untracked.h").write_text("// new, not ignored\n")
    (src / "stale.o").write_text("ignored\n")
    out = root / "output"
    (out / "lib").mkdir(parents=True)
    (out / "lib" / "libops.so").write_bytes(bytes(range(256)) * 64)
    (out / "bin").mkdir()
    (out / "bin" / "tool").write_text("#!/bin/sh\necho tool\n")
    (out / "bin" / "tool").chmod(0o755)
    (out / "lib" / "libops.so.1").symlink_to("libops.so")


KEY = ["--key-tree", "csrc", "--key-value", "image=cann-8.0.RC3", "--platform", "arch=aarch64"]


def test_push_pull_identical_tree_and_miss_after_one_byte(server: ServerProcess, tmp_path: Path) -> None:
    env = step_env(server, tmp_path / "agent", tmp_path / "runs.log")
    make_tree(tmp_path)
    pushed = artifact(["push", "l0", *KEY, "output"], tmp_path, env)
    assert pushed.returncode == 0, pushed.stderr
    pulled = artifact(["pull", "l0", *KEY, "--dest", "restored"], tmp_path, env)
    assert pulled.returncode == 0, pulled.stderr
    assert tree_bytes(tmp_path / "restored" / "output") == tree_bytes(tmp_path / "output")
    assert (tmp_path / "restored" / "output" / "bin" / "tool").stat().st_mode & 0o111
    # ignored files are not part of the key tree (git ls-files)...
    (tmp_path / "csrc" / "stale.o").write_text("changed, still ignored\n")
    assert artifact(["pull", "l0", *KEY, "--dest", "again"], tmp_path, env).returncode == 0
    # ...an untracked, not-ignored file is, and so is every other key part: a miss is exit 3
    op = tmp_path / "csrc" / "ops" / "op.cc"
    op.write_text(op.read_text().replace("1", "2"))  # one byte
    missed = artifact(["pull", "l0", *KEY, "--dest", "none"], tmp_path, env)
    assert missed.returncode == 3 and "MISS" in missed.stdout
    assert not (tmp_path / "none").exists()
    op.write_text(op.read_text().replace("2", "1"))
    assert artifact(["pull", "l0", *KEY, "--dest", "back"], tmp_path, env).returncode == 0
    other_image = [*KEY[:3], "image=cann-8.1", *KEY[4:]]
    assert artifact(["pull", "l0", *other_image, "--dest", "x1"], tmp_path, env).returncode == 3
    assert artifact(["pull", "l1", *KEY, "--dest", "x2"], tmp_path, env).returncode == 3
    (tmp_path / "csrc" / "untracked.h").write_text("// edited\n")
    assert artifact(["pull", "l0", *KEY, "--dest", "x3"], tmp_path, env).returncode == 3


def test_errors_are_not_misses(server: ServerProcess, tmp_path: Path) -> None:
    env = step_env(server, tmp_path / "agent", tmp_path / "runs.log")
    make_tree(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert artifact(["pull", "l0", *KEY, "--dest", "full"], tmp_path, env).returncode == 2  # dest not empty
    reader = {**env, "BUILDVAULT_WRITER": "0"}
    refused = artifact(["push", "l0", *KEY, "output"], tmp_path, reader)
    assert refused.returncode == 2 and "write permission" in refused.stderr
    assert artifact(["pull", "l0", *KEY, "--dest", "d"], tmp_path, env).returncode == 3  # nothing was stored
    assert artifact(["push", "../bad", *KEY, "output"], tmp_path, env).returncode == 2
    server.stop()
    assert artifact(["pull", "l0", *KEY, "--dest", "d"], tmp_path, env).returncode == 1  # unreachable: an error


def test_pins_roll_back_to_a_golden_version(server: ServerProcess, tmp_path: Path) -> None:
    env = step_env(server, tmp_path / "agent", tmp_path / "runs.log")
    make_tree(tmp_path)
    first = artifact(["push", "l0", *KEY, "--pin", "golden", "output"], tmp_path, env)
    assert first.returncode == 0, first.stderr
    golden_key = first.stdout.split("key=")[1].split()[0]
    golden = tree_bytes(tmp_path / "output")
    (tmp_path / "output" / "lib" / "libops.so").write_bytes(b"a newer, broken build")
    (tmp_path / "csrc" / "ops" / "op.cc").write_text("int op() { return 9; }\n")
    second = artifact(["push", "l0", *KEY, "output"], tmp_path, env)
    assert second.returncode == 0
    newer_key = second.stdout.split("key=")[1].split()[0]
    assert artifact(["pin", "l0", newer_key, "candidate"], tmp_path, env).returncode == 0
    listed = artifact(["pins"], tmp_path, env)
    assert listed.stdout.splitlines() == [f"l0\tcandidate\t{newer_key}", f"l0\tgolden\t{golden_key}"]
    rolled = artifact(["pull", "l0", "--pinned", "golden", "--dest", "rollback"], tmp_path, env)
    assert rolled.returncode == 0, rolled.stderr
    assert tree_bytes(tmp_path / "rollback" / "output") == golden
    assert artifact(["pull", "l0", "--pinned", "nope", "--dest", "n"], tmp_path, env).returncode == 3
    reader = {**env, "BUILDVAULT_WRITER": "0"}
    assert artifact(["unpin", "l0", "candidate"], tmp_path, reader).returncode == 2  # needs write permission
    assert artifact(["unpin", "l0", "candidate"], tmp_path, env).returncode == 0
    assert artifact(["pins"], tmp_path, env).stdout.splitlines() == [f"l0\tgolden\t{golden_key}"]
    assert artifact(["pin", "l0", "0" * 64 + "/10", "x"], tmp_path, env).returncode == 3  # no such artifact


def test_pinned_version_survives_eviction_and_shows_on_the_status_page(
    server_factory: Callable[..., ServerProcess],
    tmp_path: Path,
) -> None:
    # Plain LRU: with the eviction hold, pushes quicker than 2 s apart would fill this tiny cap
    # with held entries and be refused (that rule has tests of its own).
    server = server_factory(extra_args=["--max-size", "400KiB", "--eviction-hold", "0"])
    env = step_env(server, tmp_path / "agent", tmp_path / "runs.log")
    make_tree(tmp_path)
    lib = tmp_path / "output" / "lib" / "libops.so"
    lib.write_bytes(b"golden " * 10000)  # ~70 KB
    pinned = artifact(["push", "l0", *KEY, "--pin", "golden", "output"], tmp_path, env)
    assert pinned.returncode == 0, pinned.stderr
    golden = tree_bytes(tmp_path / "output")
    for i in range(12):  # ~840 KB of unpinned versions through a 400 KiB cap
        lib.write_bytes(f"unpinned {i} ".encode() * 6000)
        (tmp_path / "csrc" / "ops" / "op.cc").write_text(f"int op() {{ return {i + 10}; }}\n")
        assert artifact(["push", "l0", *KEY, "output"], tmp_path, env).returncode == 0
    status = json.loads(urllib.request.urlopen(f"http://{server.http_address}/status", timeout=10).read())
    assert status["evictions"] > 0 and status["current_size_bytes"] <= 400 * 1024
    assert [(p["name"], p["label"]) for p in status["pins"]] == [("l0", "golden")]
    page = urllib.request.urlopen(f"http://{server.http_address}/status.html", timeout=10).read().decode()
    assert "l0/golden" in page
    # the earliest unpinned version was evicted...
    (tmp_path / "csrc" / "ops" / "op.cc").write_text("int op() { return 10; }\n")
    assert artifact(["pull", "l0", *KEY, "--dest", "old"], tmp_path, env).returncode == 3
    # ...the pinned one is whole, and survives a restart too
    rolled = artifact(["pull", "l0", "--pinned", "golden", "--dest", "rollback"], tmp_path, env)
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    assert tree_bytes(tmp_path / "rollback" / "output") == golden
    server.restart()
    for i in range(6):
        lib.write_bytes(f"after restart {i} ".encode() * 6000)
        assert artifact(["push", "l0", *KEY, "--key-value", f"n={i}", "output"], tmp_path, env).returncode == 0
    again = artifact(["pull", "l0", "--pinned", "golden", "--dest", "rollback2"], tmp_path, env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert tree_bytes(tmp_path / "rollback2" / "output") == golden
