"""`buildvault run` against a live buildvault server: hits, misses, what joins the key, outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from run_harness import ServerProcess, run_step, runs, step_env, tree_bytes

OPS = ["add", "mul"]


def fake_tool(bin_dir: Path, version: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "ascendc"
    tool.write_text(f"#!/bin/sh\necho 'ascendc version {version}'\n")
    tool.chmod(0o755)


def op_args(op: str, *extra: str) -> list[str]:
    return [
        "--name",
        op,
        "--input",
        f"ops/{op}.cc",
        "--recipe-file",
        "op_step.sh",
        "--toolchain-file",
        "toolchain/version.info",
        "--tool",
        "ascendc",
        "--env",
        "SOC=ascend910b1",
        "--env",
        "OP_MODE=release",
        "--platform",
        "soc=ascend910b1,cann=8.0.RC3",
        "--output",
        f"out/{op}",
        *extra,
        "--",
        "./op_step.sh",
        f"ops/{op}.cc",
        f"out/{op}",
    ]


def build(checkout: Path, env: dict[str, str], *extra: str) -> dict[str, str]:
    statuses = {}
    for op in OPS:
        step = run_step(op_args(op, *extra), checkout, env)
        assert step.code == 0, step.stdout + step.stderr
        statuses[op] = step.status
    return statuses


def make_env(server: ServerProcess | None, tmp_path: Path, **extra: str) -> dict[str, str]:
    fake_tool(tmp_path / "bin", extra.pop("tool_version", "1.0"))
    env = step_env(server, tmp_path / "agent", tmp_path / "runs.log", **extra)
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    return env


def test_cold_saves_then_clean_rebuild_hits_byte_identical(
    server: ServerProcess,
    checkout: Path,
    tmp_path: Path,
) -> None:
    env = make_env(server, tmp_path)
    assert build(checkout, env) == {"add": "SAVED", "mul": "SAVED"}
    assert sorted(runs(tmp_path / "runs.log")) == ["ops/add.cc", "ops/mul.cc"]
    before = tree_bytes(checkout / "out")
    assert before["add/kernel.link"] == "link->kernel.o"
    shutil.rmtree(checkout / "out")
    step = run_step(op_args("add"), checkout, env)
    assert (step.code, step.status) == (0, "HIT")
    assert "compiled add.cc" in step.stdout and "note: fake ascend compiler" in step.stderr  # replayed
    assert run_step(op_args("mul"), checkout, env).status == "HIT"
    assert runs(tmp_path / "runs.log") == []
    assert tree_bytes(checkout / "out") == before


def test_moved_checkout_hits(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    env = make_env(server, tmp_path)
    build(checkout, env)
    runs(tmp_path / "runs.log")
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(checkout, moved, symlinks=True, ignore=shutil.ignore_patterns("out"))
    assert build(moved, env) == {"add": "HIT", "mul": "HIT"}
    assert runs(tmp_path / "runs.log") == []
    assert tree_bytes(moved / "out") == tree_bytes(checkout / "out")


def test_what_joins_the_key(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    env = make_env(server, tmp_path)
    build(checkout, env)
    runs(tmp_path / "runs.log")
    # one operator's source: exactly that step misses
    (checkout / "ops" / "mul.cc").write_text("int mul() { return 3; }\n")
    assert build(checkout, env) == {"add": "HIT", "mul": "SAVED"}
    assert runs(tmp_path / "runs.log") == ["ops/mul.cc"]
    # a toolchain file: every step misses
    (checkout / "toolchain" / "version.info").write_text("Version=8.1.RC1\n")
    assert build(checkout, env) == {"add": "SAVED", "mul": "SAVED"}
    # the --tool's version: every step misses
    env2 = make_env(server, tmp_path, tool_version="2.0")
    assert build(checkout, env2) == {"add": "SAVED", "mul": "SAVED"}
    # an --env value: misses (and the command sees it)
    args = [a if a != "OP_MODE=release" else "OP_MODE=debug" for a in op_args("add")]
    step = run_step(args, checkout, env2)
    assert step.status == "SAVED"
    assert json.loads((checkout / "out" / "add" / "meta.json").read_text())["mode"] == "debug"
    # the recipe file: misses
    script = checkout / "op_step.sh"
    script.write_text(script.read_text() + "# changed recipe\n")
    assert build(checkout, env2) == {"add": "SAVED", "mul": "SAVED"}
    # a --recipe-value and a --platform property: miss
    assert run_step(op_args("add", "--recipe-value=-O3"), checkout, env2).status == "SAVED"
    assert run_step(op_args("add", "--platform", "soc=ascend310p1"), checkout, env2).status == "SAVED"
    # and nothing else changed: hits again
    assert build(checkout, env2) == {"add": "HIT", "mul": "HIT"}
    # the variable the key leaves out (RUN_LOG) really is left out, and the environment outside
    # the step's --env does not matter
    assert build(checkout, {**env2, "UNRELATED": "x"}) == {"add": "HIT", "mul": "HIT"}


def test_directory_input_walk_excludes_and_symlinks(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    env = make_env(server, tmp_path)
    lib = checkout / "lib"
    (lib / "sub").mkdir(parents=True)
    (lib / "sub" / "a.h").write_text("int a;\n")
    (lib / "b.h").write_text("int b;\n")
    (lib / "link.h").symlink_to("b.h")
    (lib / "noise.log").write_text("1")
    args = [
        "--name",
        "lib",
        "--input",
        "lib",
        "--output",
        "out.txt",
        "--",
        "sh",
        "-c",
        'echo lib >> "$RUN_LOG"; cat lib/sub/a.h lib/link.h > out.txt',
    ]
    assert run_step(args, checkout, env).status == "SAVED"
    (lib / "noise.log").write_text("2")  # excluded by default: still a hit
    (lib / "junk.tmp").write_text("x")
    assert run_step(args, checkout, env).status == "HIT"
    (lib / "b.h").write_text("int b2;\n")  # the link's target changed: miss
    assert run_step(args, checkout, env).status == "SAVED"
    (lib / "link.h").unlink()
    (lib / "link.h").symlink_to("sub/a.h")  # the link itself changed: miss
    assert run_step(args, checkout, env).status == "SAVED"
    assert (checkout / "out.txt").read_text() == "int a;\nint a;\n"
    assert run_step([*args[:4], "--exclude", "sub", *args[4:]], checkout, env).status == "SAVED"


def test_missing_input_fails_the_step_without_running(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    env = make_env(server, tmp_path)
    step = run_step(op_args("add", "--input", "ops/none.cc"), checkout, env)
    assert step.code == 2
    assert "input not found" in step.stderr and "ops/none.cc" in step.stderr
    assert runs(tmp_path / "runs.log") == []


def test_output_dir_discovery_and_zero_outputs(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    env = make_env(server, tmp_path)
    (checkout / "gen").mkdir()
    (checkout / "gen" / "old.txt").write_text("kept, unchanged\n")
    args = [
        "--name",
        "gen",
        "--input",
        "ops/add.cc",
        "--output-dir",
        "gen",
        "--",
        "sh",
        "-c",
        'echo gen >> "$RUN_LOG"; cp ops/add.cc gen/new.cc; mkdir -p gen/d; echo x > gen/d/x; ln -sf new.cc gen/l',
    ]
    assert run_step(args, checkout, env).status == "SAVED"
    shutil.rmtree(checkout / "gen")
    (checkout / "gen").mkdir()
    step = run_step(args, checkout, env)
    assert step.status == "HIT"
    assert tree_bytes(checkout / "gen") == {
        "d/x": b"x\n",
        "l": "link->new.cc",
        "new.cc": (checkout / "ops" / "add.cc").read_bytes(),
    }
    assert runs(tmp_path / "runs.log") == ["gen"]
    nothing = ["--input", "ops/add.cc", "--output-dir", "gen", "--", "true"]
    step = run_step(nothing, checkout, env)
    assert step.code == 1 and "created or changed nothing" in step.stderr
    declared_missing = run_step(["--input", "ops/add.cc", "--output", "never", "--", "true"], checkout, env)
    assert declared_missing.code == 1 and "never" in declared_missing.stderr


def test_failing_command_is_never_stored(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    env = make_env(server, tmp_path)
    args = [
        "--input",
        "ops/add.cc",
        "--output",
        "o",
        "--",
        "sh",
        "-c",
        'echo fail >> "$RUN_LOG"; echo o > o; echo broken >&2; exit 3',
    ]
    first = run_step(args, checkout, env)
    assert (first.code, first.status) == (3, "MISS") and "broken" in first.stderr
    second = run_step(args, checkout, env)
    assert (second.code, second.status) == (3, "MISS")
    assert runs(tmp_path / "runs.log") == ["fail", "fail"]


def test_reader_never_stores(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    reader = make_env(server, tmp_path, BUILDVAULT_WRITER="0")
    assert build(checkout, reader) == {"add": "MISS", "mul": "MISS"}
    assert build(checkout, reader) == {"add": "MISS", "mul": "MISS"}
    writer = make_env(server, tmp_path)
    assert build(checkout, writer) == {"add": "SAVED", "mul": "SAVED"}
    assert build(checkout, reader) == {"add": "HIT", "mul": "HIT"}


def test_event_log_and_summary(server: ServerProcess, checkout: Path, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    env = make_env(server, tmp_path, BUILDVAULT_EVENT_LOG=str(log))
    build(checkout, env)
    build(checkout, env)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["step"], e["status"], e.get("stored", False)) for e in events] == [
        ("add", "MISS", True),
        ("mul", "MISS", True),
        ("add", "HIT", False),
        ("mul", "HIT", False),
    ]
    assert all(e["outputs"] == 4 for e in events)  # kernel.o, meta.json, source.copy, kernel.link
    summary = run_step(["--summary", str(log)], checkout, env)
    assert summary.code == 0
    assert "hits:             2" in summary.stdout and "misses:           2" in summary.stdout


def test_no_remote_runs_plainly(checkout: Path, tmp_path: Path) -> None:
    env = make_env(None, tmp_path)
    step = run_step(op_args("add"), checkout, env)
    assert (step.code, step.status) == (0, "BYPASS")
    assert runs(tmp_path / "runs.log") == ["ops/add.cc"]
    assert (checkout / "out" / "add" / "kernel.o").read_text().startswith("// ADD OPERATOR")
