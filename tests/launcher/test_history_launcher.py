"""buildvault-cc sends RequestMetadata (the build it runs under, the object file, CppCompile), so a
CMake build of the csrc-like example gets the server's build pages: after one operator header
changes, the next build's invocation lists exactly the recompiles as misses, and the explanation
of each names that header."""

from __future__ import annotations

import html
import re
import urllib.request
from pathlib import Path

from launcher_harness import Toolchain, cmake_build, copy_checkout, make_env, op_compiles
from polling import wait_for
from server_process import ServerProcess

HEADER = "csrc/ops/moe/moe_gating/op_host/moe_gating_tiling.h"


def page(server: ServerProcess, path: str) -> str:
    with urllib.request.urlopen(f"http://{server.http_address}{path}", timeout=30) as response:
        return response.read().decode()


def invocations(server: ServerProcess) -> list[str]:
    return re.findall(r'href="/invocation/([^"]+)"', page(server, "/invocations"))


def test_a_changed_operator_header_is_named_for_each_miss(tmp_path: Path, require_cmake: None) -> None:
    server = ServerProcess(tmp_path / "server" / "data", name="server").start()
    env = make_env(server)
    try:
        toolchain = Toolchain(tmp_path / "toolchain")
        checkout = copy_checkout(tmp_path / "checkout")
        cmake_build(toolchain, checkout, checkout / "build", env).check()
        first = wait_for(lambda: invocations(server), 30, "the first build's invocation")
        assert len(first) == 1, first

        header = checkout / HEADER
        header.write_text(header.read_text() + "\n// tiling retuned\n")
        second = cmake_build(toolchain, checkout, checkout / "build", env, fresh=False).check()
        recompiled = set(second.compiled)
        assert recompiled == op_compiles("moe", "moe_gating"), recompiled
        new = wait_for(lambda: [i for i in invocations(server) if i not in first], 30, "the second build's invocation")
        assert len(new) == 1, new

        def misses() -> list[str]:
            text = page(server, f"/invocation/{new[0]}")
            return re.findall(r'class="why" href="([^"]+)"', text)

        links = wait_for(lambda: (found := misses()) and len(found) == len(recompiled) and found, 30,
                         f"{len(recompiled)} misses on the invocation page")  # fmt: skip
        for link in links:
            explanation = page(server, html.unescape(link))
            assert re.search(r"input <code>[^<]*moe_gating_tiling\.h</code> changed", explanation), explanation
            assert "CppCompile" in explanation and first[0] in explanation
    finally:
        env.stop()
        server.stop()
        server.kill()
