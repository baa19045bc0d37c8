"""bazel_example's operator build scripts and third-party build as cached steps, through real
CMake (buildvault.cmake's buildvault_cached_command) against a live server."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from run_harness import BUILDVAULT, STATUS, ServerProcess, require_buildvault, runs, step_env, tree_bytes

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "bazel_example"
OPS = ["flash_attention", "paged_attention", "moe_gating", "moe_dispatch", "grouped_matmul"]
OP_DIRS = {
    "flash_attention": "attention",
    "paged_attention": "attention",
    "moe_gating": "moe",
    "moe_dispatch": "moe",
    "grouped_matmul": "gmm",
}
THIRD = "third_party_minicalc"


def fake_tool(bin_dir: Path, version: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "ascendc"
    tool.write_text(f"#!/bin/sh\necho 'ascendc (fake) {version}'\n")
    tool.chmod(0o755)


class Project:
    def __init__(self, root: Path, server: ServerProcess, tool_version: str = "1.0") -> None:
        self.root = root
        self.bin = root / "bin"
        fake_tool(self.bin, tool_version)
        self.log = root / "steps.log"
        self.toolchain = root / "cann" / "version.info"
        self.toolchain.parent.mkdir(parents=True, exist_ok=True)
        self.toolchain.write_text("Version=8.0.RC3\n")
        self.env = step_env(server, root / "agent", root / "unused.log", OP_STEP_LOG=str(self.log))
        self.env["PATH"] = f"{self.bin}:{self.env['PATH']}"

    def checkout(self, name: str = "checkout") -> Path:
        dest = self.root / name
        if not dest.exists():
            shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("build", "bazel-*", "__pycache__"))
        return dest

    def build(self, checkout: Path, *defines: str) -> dict[str, str]:
        """Fresh configure + build of the cached-step targets; {step: status}."""
        build = checkout / "build"
        if build.exists():
            shutil.rmtree(build)
        configure = [
            "cmake",
            "-S",
            str(checkout),
            "-B",
            str(build),
            "-G",
            "Ninja" if shutil.which("ninja") else "Unix Makefiles",
            "-DCSRC_CACHED_STEPS=ON",
            f"-DBUILDVAULT_EXECUTABLE={BUILDVAULT}",
            "-DCSRC_STEP_TOOLS=ascendc",
            f"-DCSRC_TOOLCHAIN_FILES={self.toolchain}",
            *defines,
        ]
        out = ""
        for argv in (configure, ["cmake", "--build", str(build), "--target", "op_steps", THIRD]):
            proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=600)
            out += proc.stdout + proc.stderr
            assert proc.returncode == 0, out[-6000:]
        found = {name: status for status, name, _ in STATUS.findall(out)}
        assert sorted(found) == sorted([f"op_{op}" for op in OPS] + [THIRD]), out[-4000:]
        return found


def all_(status: str, names: list[str] | None = None) -> dict[str, str]:
    return {f"op_{op}": status for op in (names or OPS)}


@pytest.fixture
def project(tmp_path: Path, server: ServerProcess) -> Project:
    require_buildvault()
    if shutil.which("cmake") is None:
        raise AssertionError("cmake is required for these tests (scripts/install-system-deps.sh)")
    return Project(tmp_path, server)


def outputs(checkout: Path) -> dict[str, bytes | str]:
    return tree_bytes(checkout / "build" / "op_steps") | {
        f"tp/{k}": v for k, v in tree_bytes(checkout / "build" / "third_party" / "minicalc").items()
    }


def test_operator_steps_and_third_party_build(project: Project) -> None:
    checkout = project.checkout()
    assert project.build(checkout) == {**all_("SAVED"), THIRD: "SAVED"}
    assert sorted(runs(project.log)) == sorted([*OPS, "third_party:minicalc"])
    cold = outputs(checkout)
    assert cold["flash_attention/flash_attention.kernel"] == "link->flash_attention.o"
    assert "tp/lib/libminicalc_ops.a" in cold and "tp/bin/minicalc" in cold

    # clean rebuild: every step a hit, byte-identical, no step ran
    assert project.build(checkout) == {**all_("HIT"), THIRD: "HIT"}
    assert runs(project.log) == []
    assert outputs(checkout) == cold
    calc = checkout / "build" / "third_party" / "minicalc" / "bin" / "minicalc"
    assert (
        subprocess.run([str(calc), "6", "7"], capture_output=True, text=True, check=True).stdout
        == "minicalc 6 7: add=13 mul=42\n"
    )

    # the checkout copied elsewhere: all hits
    moved = project.checkout("moved/elsewhere")
    assert project.build(moved) == {**all_("HIT"), THIRD: "HIT"}
    assert runs(project.log) == []
    assert outputs(moved) == cold


def test_what_makes_operator_steps_miss(project: Project) -> None:
    checkout = project.checkout()
    project.build(checkout)
    runs(project.log)
    kernel = checkout / "csrc" / "ops" / "moe" / "moe_gating" / "op_kernel" / "moe_gating_kernel.cc"
    kernel.write_text(kernel.read_text() + "\n// changed\n")
    assert project.build(checkout) == {**all_("HIT"), "op_moe_gating": "SAVED", THIRD: "HIT"}
    assert runs(project.log) == ["moe_gating"]

    project.toolchain.write_text("Version=8.1.RC1\n")  # CANN version file: every operator step
    assert project.build(checkout) == {**all_("SAVED"), THIRD: "HIT"}
    fake_tool(project.bin, "2.0")  # the --tool's version: every operator step
    assert project.build(checkout) == {**all_("SAVED"), THIRD: "HIT"}
    assert project.build(checkout, "-DCSRC_OP_BUILD_MODE=debug") == {**all_("SAVED"), THIRD: "HIT"}  # an --env value
    assert b'"mode": "debug"' in (checkout / "build" / "op_steps" / "moe_gating" / "moe_gating.json").read_bytes()
    script = checkout / "csrc" / "scripts" / "build_op.sh"
    script.write_text(script.read_text() + "# recipe changed\n")  # the recipe file
    assert project.build(checkout) == {**all_("SAVED"), THIRD: "HIT"}
    runs(project.log)
    assert project.build(checkout) == {**all_("HIT"), THIRD: "HIT"}
    assert runs(project.log) == []
