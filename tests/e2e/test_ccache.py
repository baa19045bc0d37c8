"""Real ccache 4.7.5 (as CMake's compiler launcher) against buildvault's HTTP remote storage.

For each layout ccache knows: a cold build writes every result and manifest to buildvault;
after `ccache -C` (local cache emptied) and a rebuild from a deleted build directory,
`ccache --print-stats` shows every compile as a remote storage hit. The three layouts name
the same key differently and share one set of entries, and none of them is visible as an
ActionResult over gRPC.
"""

from __future__ import annotations

import pytest
from ccache_harness import TRANSLATION_UNITS

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("layout", ["bazel", "subdirs", "flat"])
def test_ccache_remote_storage_clean_rebuild_is_all_remote_hits(ccache_project_factory, server, layout):
    remote = f"http://{server.http_address}/ccache|layout={layout}"
    project = ccache_project_factory("a", remote_storage=remote)

    project.build_cold()
    status = server.status()
    assert status["ac_entries"] == 2 * TRANSLATION_UNITS
    assert status["ac_misses_by_protocol"]["http"] == 2 * TRANSLATION_UNITS

    project.rebuild_all_remote_hits()
    assert server.status()["ac_hits_by_protocol"]["http"] == 2 * TRANSLATION_UNITS

    # A copy of the project elsewhere, with its own empty local cache, hits too.
    other = ccache_project_factory("b", remote_storage=remote)
    other.build()
    stats = other.stats()
    assert stats["remote_storage_hit"] == TRANSLATION_UNITS and stats["cache_miss"] == 0, other.show_stats()


def test_ccache_layouts_share_entries(ccache_project_factory, server):
    """Entries written with layout=subdirs are found with layout=bazel and layout=flat."""
    base = f"http://{server.http_address}/shared"
    writer = ccache_project_factory("writer", remote_storage=f"{base}|layout=subdirs")
    writer.build()
    assert writer.stats()["remote_storage_write"] == 2 * TRANSLATION_UNITS

    for layout in ("bazel", "flat"):
        reader = ccache_project_factory(f"reader-{layout}", remote_storage=f"{base}|layout={layout}")
        reader.build()
        stats = reader.stats()
        assert stats["remote_storage_hit"] == TRANSLATION_UNITS, reader.show_stats()
        assert stats["remote_storage_write"] == 0, reader.show_stats()
    # Still one set of entries: the readers wrote nothing new.
    assert server.status()["ac_entries"] == 2 * TRANSLATION_UNITS


def test_ccache_default_layout_is_subdirs(ccache_project_factory, server):
    """Without a layout attribute ccache uses subdirs: all remote hits, shared with layout=subdirs."""
    remote = f"http://{server.http_address}/default"
    project = ccache_project_factory("a", remote_storage=remote)
    project.build()
    project.rebuild_all_remote_hits()
    explicit = ccache_project_factory("b", remote_storage=f"{remote}|layout=subdirs")
    explicit.build()
    assert explicit.stats()["remote_storage_hit"] == TRANSLATION_UNITS, explicit.show_stats()
