"""Self-check of the e2e harness with REAL clients but WITHOUT buildvault.

* Bazel 4.2.3 against its own ``--disk_cache`` and against a throwaway
  in-test HTTP store (``selftest_http_store.py``, harness self-test only).
* ccache 4.7.5 (CMake launcher) against the same throwaway HTTP store with
  ``layout=bazel`` and ``layout=subdirs``.

These prove that the harness drives the clients and parses their output
correctly, so e2e tests against the real server only need to swap the URL.
"""

from __future__ import annotations

import re

import pytest
from bazel_harness import (
    ALL_HITS,
    CACHEABLE_SPAWNS,
    EXPECTED_OUTPUT,
    INTERNAL_SPAWNS,
    parse_process_line,
    parse_process_summary,
)
from ccache_harness import TRANSLATION_UNITS, parse_print_stats
from selftest_http_store import SelftestHttpStore

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def http_store():
    """HARNESS SELF-TEST ONLY: in-memory GET/PUT store, not the buildvault server."""
    with SelftestHttpStore() as store:
        yield store


# ---------------------------------------------------------------------------
# Parsers, on lines captured from the real clients
# ---------------------------------------------------------------------------

# Captured from Bazel 4.2.3 (Debian bazel-bootstrap) building this workspace.
BAZEL_LINES = [
    ("INFO: 18 processes: 8 internal, 10 processwrapper-sandbox.", {"internal": 8, "processwrapper-sandbox": 10}),
    (
        "INFO: 18 processes: 10 remote cache hit, 8 internal.",  # --disk_cache and --remote_cache hits alike
        {"remote cache hit": 10, "internal": 8},
    ),
    ("INFO: 18 processes: 8 internal, 10 linux-sandbox.", {"internal": 8, "linux-sandbox": 10}),
    ("INFO: 2 processes: 1 internal, 1 local.", {"internal": 1, "local": 1}),
    ("INFO: 2 processes: 1 internal, 1 processwrapper-sandbox.", {"internal": 1, "processwrapper-sandbox": 1}),
    ("INFO: 1 process: 1 internal.", {"internal": 1}),
    ("INFO: 0 processes.", {}),
    # newer-Bazel wording, accepted too
    ("INFO: 7 processes: 4 disk cache hit, 3 internal.", {"disk cache hit": 4, "internal": 3}),
]


@pytest.mark.parametrize("line,expected", BAZEL_LINES)
def test_bazel_summary_parser(line, expected):
    summary = parse_process_line(line)
    assert summary is not None
    assert summary.as_dict() == expected
    assert summary.declared_total == sum(expected.values())
    assert summary["processwrapper-sandbox"] == expected.get("processwrapper-sandbox", 0)
    assert summary.cache_hits == expected.get("remote cache hit", 0) + expected.get("disk cache hit", 0)


def test_bazel_summary_parser_picks_last_summary_and_rejects_noise():
    output = (
        "INFO: Analyzed 3 targets (17 packages loaded, 65 targets configured).\n"
        "INFO: 18 processes: 8 internal, 10 processwrapper-sandbox.\n"
        "INFO: Build completed successfully, 18 total actions\n"
        "INFO: 18 processes: 10 remote cache hit, 8 internal.\n"
        "INFO: Build completed successfully, 18 total actions\n"
    )
    assert parse_process_summary(output).as_dict() == {"remote cache hit": 10, "internal": 8}
    assert parse_process_summary("FAILED: Build did NOT complete successfully\n") is None
    with pytest.raises(ValueError):
        parse_process_line("INFO: 5 processes: 1 internal, 1 local.")


def test_ccache_print_stats_parser():
    text = (
        "cache_miss\t4\ndirect_cache_hit\t0\nremote_storage_hit\t0\nremote_storage_write\t8\n"
        "stats_updated_timestamp\t1795949446\n"
    )
    assert parse_print_stats(text) == {
        "cache_miss": 4,
        "direct_cache_hit": 0,
        "remote_storage_hit": 0,
        "remote_storage_write": 8,
        "stats_updated_timestamp": 1795949446,
    }


# ---------------------------------------------------------------------------
# Bazel
# ---------------------------------------------------------------------------


def test_bazel_disk_cache_clean_rebuild(bazel_workspace_factory, tmp_path):
    disk = tmp_path / "disk_cache"
    ws = bazel_workspace_factory("a")

    cold = ws.build(disk_cache=disk, check=True).processes
    assert cold.as_dict() == {"internal": INTERNAL_SPAWNS, "processwrapper-sandbox": CACHEABLE_SPAWNS}, cold.line

    ws.clean()
    warm = ws.build(disk_cache=disk, check=True).processes
    # Bazel 4.2.3 labels --disk_cache hits "remote cache hit".
    assert warm.cache_hits == CACHEABLE_SPAWNS, warm.line
    assert warm.executed == 0, warm.line
    assert warm["internal"] == INTERNAL_SPAWNS
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"

    # A separate copy (other path, other output_user_root, other server) gets
    # the same action keys: everything is a hit.
    other = bazel_workspace_factory("b")
    again = other.build(disk_cache=disk, check=True).processes
    assert again.cache_hits == CACHEABLE_SPAWNS and again.executed == 0, again.line
    assert other.run_binary().stdout == EXPECTED_OUTPUT + "\n"

    # Changing one source re-runs exactly its compile + the links that use it.
    other.write_file(
        "lib/base/add.cc",
        '#include "lib/base/base.h"\n'
        "namespace base {\nint Add(int a, int b) { return b + a + 0; }\n}  // namespace base\n",
    )
    partial = other.build(disk_cache=disk, check=True).processes
    assert partial.cache_hits == 0 and partial.executed == 4, partial.line  # add.cc, libbase.a, libbase.so, hello
    assert other.run_binary().stdout == EXPECTED_OUTPUT + "\n"


def test_bazel_http_remote_cache_selftest_store(bazel_workspace_factory, http_store):
    url = http_store.url + "/bazel-prefix"
    ws = bazel_workspace_factory("http")

    cold = ws.build(remote_cache=url, check=True).processes
    assert cold.executed == CACHEABLE_SPAWNS and cold.cache_hits == 0, cold.line
    reqs = http_store.requests
    kinds = {(r.method, r.path.split("/")[2]) for r in reqs}
    assert kinds == {("GET", "ac"), ("PUT", "cas"), ("PUT", "ac")}, kinds
    assert all(re.fullmatch(r"/bazel-prefix/(ac|cas)/[0-9a-f]{64}", r.path) for r in reqs)
    assert sum(1 for r in reqs if r.method == "GET") == CACHEABLE_SPAWNS
    assert sum(1 for r in reqs if r.method == "PUT" and "/ac/" in r.path) == CACHEABLE_SPAWNS
    for r in reqs:
        if r.method == "PUT":
            assert int(r.headers["content-length"]) == r.body_len
            assert "transfer-encoding" not in r.headers and "expect" not in r.headers

    http_store.clear_log()
    ws.clean()
    warm = ws.build(remote_cache=url, check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line
    assert {r.method for r in http_store.requests} == {"GET"}
    assert all(r.status == 200 for r in http_store.requests)
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"


# ---------------------------------------------------------------------------
# ccache
# ---------------------------------------------------------------------------

CCACHE_PATHS = {
    # 20-byte key as 40 hex digits, padded to 64 by repeating its start
    "bazel": re.compile(r"/ccache-prefix/ac/([0-9a-f]{40})([0-9a-f]{24})"),
    # observed: 2 hex digits "/" 31 base32hex digits (33-char key, "/" after 2)
    "subdirs": re.compile(r"/ccache-prefix/([0-9a-f]{2})/([0-9a-v]{31})"),
}


@pytest.mark.parametrize("layout", ["bazel", "subdirs"])
def test_ccache_http_remote_storage(ccache_project_factory, http_store, layout):
    remote = f"{http_store.url}/ccache-prefix|layout={layout}"
    a = ccache_project_factory("a", remote_storage=remote)

    s = a.build_cold()  # result + manifest per compile
    assert s["remote_storage_miss"] == TRANSLATION_UNITS

    reqs = http_store.requests
    assert {r.method for r in reqs} == {"GET", "PUT"}
    for r in reqs:
        m = CCACHE_PATHS[layout].fullmatch(r.path)
        assert m, r.path
        if layout == "bazel":
            assert m.group(1)[:24] == m.group(2)
        assert r.headers["user-agent"].startswith("ccache/")
        if r.method == "PUT":
            assert int(r.headers["content-length"]) == r.body_len
            assert r.headers["content-type"] == "application/octet-stream"
            assert "transfer-encoding" not in r.headers and "expect" not in r.headers

    # Local cache emptied, empty build dir: every compile is a remote hit.
    http_store.clear_log()
    s = a.rebuild_all_remote_hits()
    assert s["remote_storage_write"] == 0
    assert {r.method for r in http_store.requests} == {"GET"}

    # Another project directory with its own CCACHE_DIR (base_dir makes keys
    # path-independent): remote hits as well.
    b = ccache_project_factory("other-project", remote_storage=remote)
    b.build()
    s = b.stats()
    assert s["remote_storage_hit"] == TRANSLATION_UNITS and s["cache_miss"] == 0, b.show_stats()
