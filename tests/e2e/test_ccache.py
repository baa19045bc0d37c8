"""Real ccache, Debian's 4.7.5 and PyPI's 4.14.2 (as CMake's compiler launcher), against
buildvault's HTTP remote storage.

For each release and each layout ccache knows: a cold build writes every result and manifest to
buildvault; after `ccache -C` (local cache emptied) and a rebuild from a deleted build directory,
ccache's own statistics show every compile as a remote storage hit and no remote error. 4.7
names keys 4 hex + 29 base32hex, 4.8 and later 40 hex digits; the layouts name the same key
differently and share one set of entries, and none of them is visible as an ActionResult over
gRPC. The same holds with a bearer token (`bearer-token`, and 4.14's `@header=Authorization=…`).

Each test prints its statistics lines (`-rP` shows them).
"""

from __future__ import annotations

import pytest
from auth_setup import bearer, new_token, status
from ccache_harness import EXPECTED_OUTPUT, TRANSLATION_UNITS, CcacheProject
from required_tools import DEBIAN_CCACHE, WHEEL_CCACHE, ccache_release

pytestmark = pytest.mark.timeout(600)

RELEASES = [DEBIAN_CCACHE, WHEEL_CCACHE]
LAYOUTS = ["bazel", "subdirs", "flat"]
REPORTED = ("cache_miss", "direct_cache_hit", "remote_storage_hit", "remote_storage_miss",
            "remote_storage_write", "remote_storage_error", "remote_storage_timeout")


def remote(release: str, base: str, *attrs: str, bars: bool | None = None) -> str:
    """ccache's `remote_storage` for `release`: 4.7 takes `url|key=value|…`; 4.14 writes
    `url @key=value …` (and still reads the `|` form: `bars=True`)."""
    if bars if bars is not None else release == DEBIAN_CCACHE:
        return "|".join([base, *attrs])
    return " ".join([base, *(f"@{a}" for a in attrs)])


def report(project: CcacheProject, what: str) -> dict[str, int]:
    """ccache's statistics of `project`, printed as one line for the record."""
    stats = project.stats()
    version = project.ccache_cmd("--version").stdout.splitlines()[0]
    print(f"{version} {what}: " + " ".join(f"{k}={stats.get(k, 0)}" for k in REPORTED))
    return stats


@pytest.fixture(params=RELEASES, ids=lambda v: f"ccache{v}")
def release(request) -> str:
    return str(request.param)


@pytest.fixture
def ccache_exe(release, require_ccache) -> str:
    return ccache_release(release)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ccache_remote_storage_clean_rebuild_is_all_remote_hits(
    ccache_project_factory, server, release, ccache_exe, layout
):
    url = remote(release, f"http://{server.http_address}/ccache", f"layout={layout}")
    project = ccache_project_factory("a", remote_storage=url, ccache=ccache_exe)

    project.build_cold()
    report(project, f"layout={layout} cold")
    status_ = server.status()
    assert status_["ac_entries"] == 2 * TRANSLATION_UNITS
    assert status_["ac_misses_by_protocol"]["http"] == 2 * TRANSLATION_UNITS

    project.rebuild_all_remote_hits()
    report(project, f"layout={layout} after ccache -C")
    assert server.status()["ac_hits_by_protocol"]["http"] == 2 * TRANSLATION_UNITS

    # A copy of the project elsewhere, with its own empty local cache, hits too.
    other = ccache_project_factory("b", remote_storage=url, ccache=ccache_exe)
    other.build()
    stats = report(other, f"layout={layout} second checkout")
    assert stats["remote_storage_hit"] == TRANSLATION_UNITS and stats["cache_miss"] == 0, other.show_stats()
    assert stats["remote_storage_error"] == 0, other.show_stats()


def test_ccache_layouts_share_entries(ccache_project_factory, server, release, ccache_exe):
    """Entries written with layout=subdirs are found with layout=bazel and layout=flat (4.14
    reads one of them with the old `|` form)."""
    base = f"http://{server.http_address}/shared"
    writer = ccache_project_factory("writer", remote_storage=remote(release, base, "layout=subdirs"), ccache=ccache_exe)
    writer.build()
    assert report(writer, "layout=subdirs writer")["remote_storage_write"] == 2 * TRANSLATION_UNITS

    for layout, bars in (("bazel", True), ("flat", None)):
        url = remote(release, base, f"layout={layout}", bars=bars)
        reader = ccache_project_factory(f"reader-{layout}", remote_storage=url, ccache=ccache_exe, debug_log=True)
        reader.build()
        stats = report(reader, f"layout={layout} reader of subdirs")
        assert stats["remote_storage_hit"] == TRANSLATION_UNITS, reader.show_stats()
        assert stats["remote_storage_write"] == 0, reader.show_stats()
        # ccache took the layout attribute (a missed one would fall back to subdirs and hit too).
        assert ("to Bazel layout ac/" in reader.log()) == (layout == "bazel")
    # Still one set of entries: the readers wrote nothing new.
    assert server.status()["ac_entries"] == 2 * TRANSLATION_UNITS


def test_ccache_default_layout_is_subdirs(ccache_project_factory, server, release, ccache_exe):
    """Without a layout attribute ccache uses subdirs: all remote hits, shared with layout=subdirs."""
    url = f"http://{server.http_address}/default"
    project = ccache_project_factory("a", remote_storage=url, ccache=ccache_exe)
    project.build_cold()
    project.rebuild_all_remote_hits()
    report(project, "default layout after ccache -C")
    explicit = ccache_project_factory("b", remote_storage=remote(release, url, "layout=subdirs"), ccache=ccache_exe)
    explicit.build()
    assert report(explicit, "layout=subdirs reader of default")["remote_storage_hit"] == TRANSLATION_UNITS


# -- with a bearer token ----------------------------------------------------------------------


@pytest.fixture
def token_server(tmp_path, servers):
    tokens = tmp_path / "tokens"
    token = new_token(tokens, "ci-token")
    server = servers("auth", "--token-file", str(tokens))
    server.token = token  # type: ignore[attr-defined]
    return server


def entries(server) -> int:
    return int(status(server.http_address, bearer(server.token))["ac_entries"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ccache_bearer_token_writes_and_hits(ccache_project_factory, token_server, release, ccache_exe, layout):
    base = f"http://{token_server.http_address}/bearer"
    url = remote(release, base, f"layout={layout}", f"bearer-token={token_server.token}")
    cold = ccache_project_factory("a", remote_storage=url, ccache=ccache_exe)
    cold.build_cold()
    report(cold, f"layout={layout} bearer-token cold")
    assert entries(token_server) == 2 * TRANSLATION_UNITS
    warm = ccache_project_factory("b", remote_storage=url, ccache=ccache_exe)
    warm.rebuild_all_remote_hits()
    report(warm, f"layout={layout} bearer-token second checkout")

    # Without the token the compiles still succeed, ccache counts remote errors, nothing is stored.
    anon = ccache_project_factory("anon", remote_storage=remote(release, base, f"layout={layout}"), ccache=ccache_exe)
    anon.build()
    assert anon.run_binary().stdout == EXPECTED_OUTPUT + "\n"
    stats = report(anon, f"layout={layout} no token")
    assert stats["cache_miss"] == TRANSLATION_UNITS and stats["remote_storage_hit"] == 0, anon.show_stats()
    assert stats["remote_storage_error"] > 0, anon.show_stats()
    assert entries(token_server) == 2 * TRANSLATION_UNITS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ccache_4_14_authorization_header_writes_and_hits(ccache_project_factory, token_server, layout):
    """4.14's `@header=Authorization=Bearer%20<token>` (percent-encoded space) instead of @bearer-token."""
    exe = ccache_release(WHEEL_CCACHE)
    url = remote(WHEEL_CCACHE, f"http://{token_server.http_address}/header", f"layout={layout}",
                 f"header=Authorization=Bearer%20{token_server.token}")
    cold = ccache_project_factory("a", remote_storage=url, ccache=exe)
    cold.build_cold()
    report(cold, f"layout={layout} @header cold")
    assert entries(token_server) == 2 * TRANSLATION_UNITS
    warm = ccache_project_factory("b", remote_storage=url, ccache=exe)
    warm.rebuild_all_remote_hits()
    report(warm, f"layout={layout} @header second checkout")
