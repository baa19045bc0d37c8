"""`buildvault run` sends RequestMetadata: its steps appear on the server's invocation page under
the build's id (BUILDVAULT_INVOCATION_ID here), with the step's name as the mnemonic and its output
as the target; a miss, then a hit in the next build."""

from __future__ import annotations

import re
import shutil
import urllib.request
from pathlib import Path

from polling import wait_for
from run_harness import ServerProcess, run_step
from test_run_step import make_env, op_args


def page(server: ServerProcess, path: str) -> str:
    with urllib.request.urlopen(f"http://{server.http_address}{path}", timeout=30) as response:
        return response.read().decode()


def test_steps_are_recorded_with_the_build_id_step_name_and_output(server: ServerProcess, checkout: Path,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    env = make_env(server, tmp_path)
    first = run_step(op_args("add"), checkout, {**env, "BUILDVAULT_INVOCATION_ID": "ci-build-1"})
    assert (first.code, first.status) == (0, "SAVED"), first.stderr
    shutil.rmtree(checkout / "out")
    second = run_step(op_args("add"), checkout, {**env, "BUILDVAULT_INVOCATION_ID": "ci-build-2"})
    assert (second.code, second.status) == (0, "HIT"), second.stderr

    def counts(invocation: str) -> tuple[str, str] | None:
        text = page(server, f"/invocation/{invocation}")
        hits, misses = re.search(r'id="hits">(\d+)<', text), re.search(r'id="misses">(\d+)<', text)
        return (hits.group(1), misses.group(1)) if hits and misses else None

    assert wait_for(lambda: counts("ci-build-1") == ("0", "1"), 30, "build 1: one miss")
    assert wait_for(lambda: counts("ci-build-2") == ("1", "0"), 30, "build 2: one hit")
    text = page(server, "/invocation/ci-build-1")
    misses = text.split("<h2>Misses")[1]
    assert "<code>add</code>" in misses and "<code>out/add</code>" in misses and "buildvault-run" in text, misses
