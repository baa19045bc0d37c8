"""The object tier's metrics: read from ObjectTier.stats() at scrape time, absent without a bucket."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from buildvault.server.metrics import Metrics
from buildvault.storage.objectstore.journal import JournalStats


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def tier_stats(**journal: float) -> dict:
    return {
        "healthy": False,
        "requests": {"HEAD": 7, "PUT": 3, "MULTIPART_PART": 0, "Not A Label!": 1},
        "corrupt_objects": 2,
        "presence_entries": 1000,
        "cas": {"fast_hits": 5, "slow_hits": 4},
        "ac": {"misses": 1},
        "journal": JournalStats(**{
            "backlog": 12, "oldest_pending_age": 3.5, "uploads_ok": 40, "uploads_failed": 6,
            "bytes_uploaded": 1 << 20, "in_flight": 2, "paused": True, "fsyncs": 9, **journal,
        }),
    }  # fmt: skip


def test_without_a_bucket_there_are_no_object_store_metrics():
    names = {name for name, _ in samples(Metrics())}
    assert not any("object_store" in n or "upload_journal" in n or "object_tier" in n for n in names)


def test_collected_from_the_tier_at_every_scrape():
    metrics = Metrics()
    stats = tier_stats()
    metrics.watch_object_tier(lambda: stats)
    s = samples(metrics)
    assert s[("buildvault_object_store_up", ())] == 0
    assert s[("buildvault_object_store_requests_total", (("operation", "head"),))] == 7
    assert s[("buildvault_object_store_requests_total", (("operation", "put"),))] == 3
    assert not any("Not A Label" in str(labels) for _, labels in s)  # bounded label values only
    assert s[("buildvault_upload_journal_backlog", ())] == 12
    assert s[("buildvault_upload_journal_oldest_pending_age_seconds", ())] == 3.5
    assert s[("buildvault_object_store_uploads_total", (("result", "ok"),))] == 40
    assert s[("buildvault_object_store_uploads_total", (("result", "failed"),))] == 6
    assert s[("buildvault_object_store_uploaded_bytes_total", ())] == 1 << 20
    assert s[("buildvault_object_store_presence_entries", ())] == 1000
    assert s[("buildvault_object_store_corrupt_objects_total", ())] == 2
    assert s[("buildvault_object_tier_events_total", (("event", "slow_hits"), ("store", "cas")))] == 4

    stats = {**tier_stats(backlog=0), "healthy": True}  # read again at the next scrape
    s = samples(metrics)
    assert s[("buildvault_upload_journal_backlog", ())] == 0 and s[("buildvault_object_store_up", ())] == 1


def test_read_only_tier_has_no_journal_metrics_and_a_failing_tier_does_not_break_scrapes():
    metrics = Metrics()
    metrics.watch_object_tier(lambda: {**tier_stats(), "journal": None})
    names = {name for name, _ in samples(metrics)}
    assert "buildvault_object_store_requests_total" in names
    assert not any("upload" in n for n in names)

    def broken() -> dict:
        raise RuntimeError("no stats")

    metrics.watch_object_tier(broken)
    assert ("buildvault_start_time_seconds", ()) in samples(metrics)
