"""Real Bazel 4.2.3 against buildvault, then the build pages: each invocation is listed with the
counts Bazel printed, and the explanation of every miss names what changed (a `--copt` argument,
a header when the client uploaded the input tree, or that it did not)."""

from __future__ import annotations

import html
import re
import urllib.request

import pytest
from bazel_harness import CACHEABLE_SPAWNS
from polling import wait_for

pytestmark = pytest.mark.timeout(1200)

HEADER = "lib/base/base.h"
REMOTE_FLAGS = ("--spawn_strategy=remote", "--noremote_local_fallback")


def page(server, path: str) -> str:
    with urllib.request.urlopen(f"http://{server.http_address}{path}", timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def invocation_ids(server) -> list[str]:
    return re.findall(r'href="/invocation/([^"]+)"', page(server, "/invocations"))


def new_invocation(server, before: list[str]) -> str:
    found = wait_for(lambda: [i for i in invocation_ids(server) if i not in before], 30, "the new invocation")
    assert len(found) == 1, found
    return str(found[0])


def counts(server, invocation: str) -> tuple[int, int]:
    text = page(server, f"/invocation/{invocation}")
    hits = re.search(r'id="hits">([\d,]+)<', text)
    misses = re.search(r'id="misses">([\d,]+)<', text)
    assert hits and misses, text[:2000]
    return int(hits.group(1).replace(",", "")), int(misses.group(1).replace(",", ""))


def explanations(server, invocation: str) -> list[tuple[str, str]]:
    """(mnemonic, explanation page) of every miss listed on the invocation's page."""
    text = page(server, f"/invocation/{invocation}")
    misses = text.split("<h2>Misses")[1]
    rows = re.findall(r'<tr><td><a class="why" href="([^"]+)">[^<]*</a></td><td><code>([^<]*)</code></td>', misses)
    return [(mnemonic, page(server, html.unescape(url))) for url, mnemonic in rows]


def build(ws, server, *flags: str):  # type: ignore[no-untyped-def]
    before = invocation_ids(server)
    result = ws.build(*flags, check=True)
    invocation = new_invocation(server, before)
    summary = result.processes
    # Every cacheable spawn was looked up once: a hit, or a miss that then ran.
    wait_for(lambda: counts(server, invocation) == (summary.cache_hits, summary.executed), 30,
             f"the page's counts to match Bazel's {summary.line!r}")  # fmt: skip
    return invocation, summary


def test_remote_cache_only_a_copt_change_is_named_and_a_header_change_said_unuploaded(bazel_workspace_factory,
                                                                                      server) -> None:  # fmt: skip
    ws = bazel_workspace_factory("cache-only")
    cache = f"--remote_cache=grpc://{server.grpc_address}"
    first, summary = build(ws, server, cache, "--copt=-O1")
    assert summary.executed == CACHEABLE_SPAWNS

    second, summary = build(ws, server, cache, "--copt=-O2")
    assert summary.executed == CACHEABLE_SPAWNS
    compiles = [text for mnemonic, text in explanations(server, second) if mnemonic == "CppCompile"]
    assert len(compiles) == 5
    for text in compiles:
        assert "the argument <code>-O1</code> became <code>-O2</code>" in text, text
        assert "the same output paths" in text

    ws.write_file(HEADER, (ws.path / HEADER).read_text() + "// a comment changes the header\n")
    third, summary = build(ws, server, cache, "--copt=-O2")
    compiles = [text for mnemonic, text in explanations(server, third) if mnemonic == "CppCompile"]
    assert len(compiles) >= 3 and summary.executed >= 3  # at least lib/base's own three compiles
    for text in compiles:
        assert "the input root differs, and the client did not upload" in text, text
        assert "argument" not in text.split("What changed")[1]


def test_remote_execution_a_header_change_is_named_and_the_action_shows_worker_and_tree(
    bazel_workspace_factory, servers
) -> None:
    server = servers("exec", "--local-workers", "2")
    ws = bazel_workspace_factory("remote")
    flags = (f"--remote_executor=grpc://{server.grpc_address}", *REMOTE_FLAGS)
    first, summary = build(ws, server, *flags)
    assert summary["remote"] == CACHEABLE_SPAWNS

    ws.write_file(HEADER, (ws.path / HEADER).read_text() + "// a comment changes the header\n")
    second, summary = build(ws, server, *flags)
    assert summary["remote"] >= 3
    compiles = [text for mnemonic, text in explanations(server, second) if mnemonic == "CppCompile"]
    assert len(compiles) >= 3
    for text in compiles:
        assert f"input <code>{HEADER}</code> changed" in text, text

    action = re.search(r'<a href="(/action/[^"]+)">', compiles[0].split("<h1>")[1])
    assert action is not None
    text = page(server, html.unescape(action.group(1)))
    assert "<h3>Execution</h3>" in text and "worker" in text
    assert re.search(r"<td><code>[^<]+</code></td>", text.split("<h3>Execution</h3>")[1])  # the worker's name
    assert ">lib/</a>" in text or ">bazel-out/</a>" in text  # the input tree, browsable


OK_TEST = "#!/bin/sh\necho the-test-log-line\n"
COVERAGE_STUB_BUILD = '''
package(default_visibility = ["//visibility:public"])
sh_binary(name = "coverage_report_generator", srcs = ["noop.sh"])
sh_binary(name = "lcov_merger", srcs = ["noop.sh"])
'''


def test_bes_streams_the_invocation_with_its_test_log(bazel_workspace_factory, server) -> None:
    ws = bazel_workspace_factory("bes")
    ws.write_file("extra/BUILD", 'sh_test(name = "ok_test", srcs = ["ok_test.sh"])\n')
    ws.write_file("extra/ok_test.sh", OK_TEST).chmod(0o755)
    # Offline `bazel test` needs @remote_coverage_tools: no-op coverage tools.
    ws.write_file("third_party/coverage_stub/WORKSPACE", "")
    ws.write_file("third_party/coverage_stub/BUILD", COVERAGE_STUB_BUILD)
    ws.write_file("third_party/coverage_stub/noop.sh", "#!/bin/sh\nexit 0\n").chmod(0o755)
    workspace = (ws.path / "WORKSPACE").read_text()
    ws.write_file("WORKSPACE", workspace + '\nlocal_repository(name = "remote_coverage_tools", '
                  'path = "third_party/coverage_stub")\n')  # fmt: skip
    results = f"http://{server.http_address}/invocation/"
    result = ws.run("test", f"--remote_cache=grpc://{server.grpc_address}", f"--bes_backend=grpc://{server.grpc_address}",
                    f"--bes_results_url={results}", "--", "//extra:ok_test", "//app:hello").check()  # fmt: skip
    link = re.search(re.escape(results) + r"([0-9a-f-]{36})", result.output)
    assert link is not None, result.output[-3000:]
    invocation = link.group(1)
    summary = result.processes
    wait_for(lambda: counts(server, invocation) == (summary.cache_hits, summary.executed), 30,
             f"the page's counts to match Bazel's {summary.line!r}")  # fmt: skip
    # The stream's events are written as it ends, around when Bazel exits.
    def with_events() -> str:
        text = page(server, f"/invocation/{invocation}")
        return text if "SUCCESS" in text else ""

    text = wait_for(with_events, 30, "the build events on the invocation page")
    assert "test //extra:ok_test //app:hello" in text
    assert "(exit code 0 SUCCESS)" in text
    assert "<code>//app:hello</code></td><td>built" in text
    assert "<code>//extra:ok_test</code></td><td>PASSED" in text
    log = re.search(r'test\.log: <a class="log" href="([^"]+)"', text)
    assert log is not None, text
    assert "the-test-log-line" in page(server, html.unescape(log.group(1)))
