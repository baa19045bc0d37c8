"""Acceptance: real CMake builds of bazel_example/ through buildvault-cc against a live buildvault
server, asserting exactly which compiles really ran (counted by the compiler shim)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from launcher_harness import (
    ALL_COMPILES,
    COMPAT_INCLUDERS,
    SOC_DEPENDENT,
    THIRD_PARTY,
    Build,
    LauncherEnv,
    Toolchain,
    cmake_build,
    copy_checkout,
    make_env,
    objects,
    op_compiles,
    read_events,
    start_server,
)
from polling import wait_for

EXPECTED_OUTPUT = "csrc-demo:ok soc=ascend910b1 total=490"


@dataclass
class Fleet:
    root: Path
    server: object
    env: LauncherEnv
    toolchain: Toolchain
    checkout: Path
    cold: Build
    events: Path

    def checkout_copy(self, name: str) -> Path:
        return copy_checkout(self.root / name)

    def build(
        self, checkout: Path, build_dir: str = "build", env: dict[str, str] | None = None, **kwargs: Any
    ) -> Build:
        return cmake_build(self.toolchain, checkout, checkout / build_dir, env or self.env, **kwargs).check()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, require_cmake: None) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    server = start_server(root)
    events = root / "events.jsonl"
    env = make_env(server, BUILDVAULT_EVENT_LOG=str(events))
    toolchain = Toolchain(root / "toolchain")
    try:
        checkout = copy_checkout(root / "checkout-a")
        cold = cmake_build(toolchain, checkout, checkout / "build", env).check()
        yield Fleet(root, server, env, toolchain, checkout, cold, events)
    finally:
        env.stop()
        shutil.rmtree(env["BUILDVAULT_AGENT_DIR"], ignore_errors=True)
        server.stop()
        server.kill()


def run_demo(build: Build) -> str:
    done = subprocess.run([str(build.build / "op_registry_demo")], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_cold_build_runs_every_compile(fleet: Fleet) -> None:
    assert len(ALL_COMPILES) == 20
    assert sorted(fleet.cold.compiled) == sorted(ALL_COMPILES)
    misses = [e for e in read_events(fleet.events) if e["status"] == "MISS"]
    assert len(misses) == 20 and all(e["reason"] == "stored" for e in misses), misses
    assert run_demo(fleet.cold) == EXPECTED_OUTPUT


def test_warm_rebuild_after_deleting_build_dir_runs_nothing(fleet: Fleet) -> None:
    fleet.events.write_text("")
    warm = fleet.build(fleet.checkout)  # build dir deleted first
    assert warm.compiled == []
    events = read_events(fleet.events)
    assert [e["status"] for e in events] == ["HIT"] * 20
    assert all(e["outputs"] == 2 for e in events)  # object + dependency file
    assert run_demo(warm) == EXPECTED_OUTPUT


def test_another_machine_fresh_agent_runs_nothing(fleet: Fleet, env_factory: Callable[..., LauncherEnv]) -> None:
    """A fresh agent (no local manifests or hashes): everything comes from the server."""
    env = env_factory(fleet.server)
    warm = fleet.build(fleet.checkout_copy("machine-b/checkout"), env=env)
    assert warm.compiled == []


def test_same_tree_at_another_checkout_path_runs_nothing(fleet: Fleet) -> None:
    moved = fleet.checkout_copy("elsewhere/much/deeper/checkout-b")
    assert fleet.build(moved).compiled == []


def test_build_dir_at_another_depth_runs_nothing(fleet: Fleet) -> None:
    checkout = fleet.checkout_copy("checkout-depth")
    assert fleet.build(checkout, "_build/x86_64-release").compiled == []
    assert fleet.build(checkout, "build").compiled == []


def test_tiling_header_edit_runs_only_that_operators_compiles(fleet: Fleet) -> None:
    checkout = fleet.checkout_copy("checkout-tiling")
    header = checkout / "csrc/ops/attention/flash_attention/op_host/flash_attention_tiling.h"
    header.write_text(header.read_text().replace("int64_t stages = 2;", "int64_t stages = 5;"))
    build = fleet.build(checkout)
    assert build.compiled_set == op_compiles("attention", "flash_attention")
    assert len(build.compiled) == 3
    # The edited tree at yet another path is now a full hit.
    again = fleet.checkout_copy("checkout-tiling-2")
    shutil.copy(header, again / "csrc/ops/attention/flash_attention/op_host/flash_attention_tiling.h")
    assert fleet.build(again).compiled == []


def test_force_included_header_edit_runs_exactly_its_includers(fleet: Fleet) -> None:
    checkout = fleet.checkout_copy("checkout-compat")
    header = checkout / "csrc/common/include/cann_compat.h"
    header.write_text(header.read_text().replace("#define CANN_COMPAT_LEVEL 3", "#define CANN_COMPAT_LEVEL 4"))
    build = fleet.build(checkout)
    assert build.compiled_set == COMPAT_INCLUDERS
    assert len(build.compiled) == 6


def test_soc_change_runs_every_soc_dependent_compile_but_not_third_party(fleet: Fleet) -> None:
    checkout = fleet.checkout_copy("checkout-soc")
    env = LauncherEnv(fleet.env)
    env["BUILDVAULT_PLATFORM"] = "soc=ascend310p1,cann=8.0.RC3"
    build = fleet.build(checkout, env=env, soc="ascend310p1")
    assert build.compiled_set == SOC_DEPENDENT
    assert not (build.compiled_set & THIRD_PARTY)
    assert len(build.compiled) == 18


def test_compiler_replaced_by_another_version_runs_every_compile(fleet: Fleet) -> None:
    checkout = fleet.checkout_copy("checkout-compiler")
    fleet.toolchain.install("v2")
    try:
        build = fleet.build(checkout)
        assert sorted(build.compiled) == sorted(ALL_COMPILES)
    finally:
        fleet.toolchain.install("v1")
    assert fleet.build(checkout).compiled == []  # v1 again: all hits


def test_editing_or_adding_a_file_nobody_includes_runs_nothing(fleet: Fleet) -> None:
    checkout = fleet.checkout_copy("checkout-unused")
    (checkout / "csrc/common/include/legacy_unused.h").write_text("#pragma once\n#define LEGACY_TILE 128\n")
    (checkout / "csrc/common/include/brand_new_unused.h").write_text("#pragma once\n")
    (checkout / "README.txt").write_text("notes\n")
    assert fleet.build(checkout).compiled == []


def test_new_header_shadowing_an_included_one_recompiles_its_includers(fleet: Fleet) -> None:
    """A new file earlier on the include path changes what the compiler reads: no stale hit."""
    checkout = fleet.checkout_copy("checkout-shadow")
    original = (checkout / "csrc/common/include/op_common.h").read_text()
    shadow = checkout / "csrc/ops/attention/flash_attention/op_host/op_common.h"
    shadow.write_text(original.replace("struct TensorDesc {", "struct TensorDesc { int shadowed = 1;"))
    build = fleet.build(checkout)
    assert build.compiled_set == {
        "csrc/ops/attention/flash_attention/op_host/flash_attention.cc",
        "csrc/ops/attention/paged_attention/op_host/paged_attention.cc",
    }


def test_every_hit_is_byte_identical_to_a_fresh_compile(fleet: Fleet) -> None:
    checkout = fleet.checkout_copy("checkout-identical")
    hits = fleet.build(checkout)
    assert hits.compiled == []
    cached = objects(hits.build)
    (checkout / "build").rename(checkout / "build-hits")
    fresh = cmake_build(fleet.toolchain, checkout, checkout / "build", fleet.env, launcher=False).check()
    assert sorted(fresh.compiled) == sorted(ALL_COMPILES)
    compiled = objects(fresh.build)
    object_names = [n for n in compiled if n.endswith(".o")]
    assert len(object_names) == 20
    stale = [n for n in object_names if cached.get(n) != compiled[n]]
    assert stale == [], f"{len(stale)} stale hits: {stale}"


def test_server_stopped_mid_build_still_builds(
    tmp_path: Path, require_cmake: None, env_factory: Callable[..., LauncherEnv]
) -> None:
    server = start_server(tmp_path)
    events = tmp_path / "events.jsonl"
    env = env_factory(server, BUILDVAULT_EVENT_LOG=str(events))
    toolchain = Toolchain(tmp_path / "toolchain")
    checkout = copy_checkout(tmp_path / "checkout")
    stopper_done = threading.Event()

    def stop_after_first_compiles() -> None:
        wait_for(lambda: len(read_events(events)) >= 4, 300, "four compiles in the event log", interval=0.05)
        server.stop()
        stopper_done.set()

    thread = threading.Thread(target=stop_after_first_compiles, daemon=True)
    thread.start()
    try:
        build = cmake_build(toolchain, checkout, checkout / "build", env)
        thread.join(60)
        build.check()
        assert stopper_done.is_set()
        assert sorted(build.compiled) == sorted(ALL_COMPILES)
        assert run_demo(build) == EXPECTED_OUTPUT
        found = read_events(events)
        assert len(found) == 20 and "HIT" not in [e["status"] for e in found]
        # the stop came mid-build: the later compiles met the stopped server and went on locally
        reasons = [e["reason"] for e in found]
        assert {"remote-error", "remote-unavailable", "upload-failed"} & set(reasons), reasons
        assert build.output.count("remote cache unavailable") <= 2  # one warning per agent outage
    finally:
        server.kill()
