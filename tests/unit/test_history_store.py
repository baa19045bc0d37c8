"""The history database and its recorder: metadata parsing, totals, retention, and failures that
are logged and skipped, never raised."""

from __future__ import annotations

import sqlite3

import pytest

from buildvault.history import Recorder, parse_metadata
from buildvault.history.metadata import FIELD_LIMIT, METADATA_KEY, metadata_header
from buildvault.history.store import HistoryStore


def _meta(invocation: str = "inv-1", target: str = "//a:b", mnemonic: str = "CppCompile"):
    return parse_metadata([metadata_header(tool="bazel", tool_version="4.2.3", invocation=invocation,
                                           target=target, mnemonic=mnemonic, action_id="x")])  # fmt: skip


def test_metadata_is_parsed_from_the_binary_header() -> None:
    meta = _meta()
    assert (meta.tool, meta.tool_version, meta.invocation, meta.target, meta.mnemonic, meta.malformed) == (
        "bazel", "4.2.3", "inv-1", "//a:b", "CppCompile", False)  # fmt: skip


def test_malformed_or_absent_metadata_never_raises() -> None:
    assert parse_metadata([(METADATA_KEY, b"\xff\xff\xff\xff")]).malformed
    assert parse_metadata([(METADATA_KEY, "text, not bytes")]).malformed
    assert parse_metadata(None).invocation == ""
    assert not parse_metadata([("other", b"x")]).malformed


def test_huge_metadata_fields_are_cut() -> None:
    meta = parse_metadata([metadata_header(tool="t", invocation="i" * 100_000)])
    assert len(meta.invocation) == FIELD_LIMIT


async def test_recorded_calls_become_rows_and_invocation_totals(tmp_path) -> None:
    recorder = Recorder(tmp_path / "h.sqlite", clock=lambda: 150.0)  # retention counts from this clock
    await recorder.start()
    meta = _meta()
    for outcome, method in (("miss", "ac_get"), ("upload", "ac_update"), ("hit", "ac_get"), ("hit", "ac_get")):
        recorder.record("grpc", method, "", "ab/3", outcome, "OK", 0, 100.0, 0.01, meta)
    recorder.record("grpc", "write", "", "cd/7", "upload", "OK", 7, 101.0, 0.01, meta)
    await recorder.flush()
    summary = recorder.store.invocation("inv-1")
    assert summary is not None
    assert (summary.hits, summary.misses, summary.uploads, summary.bytes_up, summary.requests) == (2, 1, 1, 7, 5)
    assert summary.tool == "bazel" and summary.outcome == "ok"
    rows = recorder.store.requests_of("inv-1")
    assert [r.outcome for r in rows][:3] == ["miss", "upload", "hit"]
    assert recorder.store.same_step("", "//a:b", "CppCompile", 200.0, exclude_digest="zz/1")[0][0] == "ab/3"
    await recorder.close()


async def test_retention_drops_old_rows_then_the_oldest_to_fit_the_size_cap(tmp_path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite")
    store.open()
    meta = _meta()
    row = lambda t, d: (t, 0.0, "grpc", "ac_get", "", d, "hit", "OK", 0, meta.invocation, "", "", "m",  # noqa: E731
                        "x" * 200, "", "bazel", "", 0)  # fmt: skip
    store.write([row(float(t), f"{t:064x}/1") for t in range(20_000)])
    assert store.prune(now=20_000.0 + 100, max_age=10_100.0, max_bytes=0) == 10_000
    assert store.requests_for(f"{9_999:064x}/1") == []
    assert store.requests_for(f"{10_000:064x}/1") != []
    before = store.live_bytes()
    cap = before // 2
    dropped = store.prune(now=20_100.0, max_age=1e9, max_bytes=cap)
    assert dropped > 0 and store.live_bytes() <= cap
    assert store.requests_for(f"{19_999:064x}/1") != []  # the newest stay
    store.close()


async def test_a_full_database_is_logged_and_skipped(tmp_path, caplog) -> None:
    recorder = Recorder(tmp_path / "h.sqlite")
    await recorder.start()
    await recorder.run_in_writer(lambda store: store._connection().execute("PRAGMA max_page_count=1"))
    for n in range(1000):  # more than the pages the file has
        recorder.record("grpc", "ac_get", "", f"{n:064x}/3", "hit", "OK", 0, 1.0, 0.0, _meta())
    await recorder.flush()  # does not raise
    assert recorder.failures == 1 and recorder.dropped == 1000
    assert "history write of 1000 records failed (database or disk is full)" in caplog.text
    await recorder.close()


async def test_a_broken_database_file_turns_recording_off(tmp_path, caplog) -> None:
    path = tmp_path / "h.sqlite"
    path.write_bytes(b"this is not a database" * 1000)
    recorder = Recorder(path)
    await recorder.start()
    assert not recorder.enabled
    recorder.record("grpc", "ac_get", "", "ab/3", "hit", "OK", 0, 1.0, 0.0, _meta())  # ignored
    await recorder.flush()
    await recorder.close()
    assert "recording is off" in caplog.text


async def test_a_full_queue_drops_and_counts(tmp_path) -> None:
    recorder = Recorder(tmp_path / "h.sqlite", max_pending=3, clock=lambda: 2.0)
    await recorder.start()
    for _ in range(5):
        recorder.record("grpc", "ac_get", "", "ab/3", "hit", "OK", 0, 1.0, 0.0, _meta())
    assert recorder.dropped == 2
    await recorder.close()
    with sqlite3.connect(tmp_path / "h.sqlite") as c:
        assert c.execute("SELECT count(*) FROM requests").fetchone()[0] == 3
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("text,seconds", [("7d", 604800.0), ("12h", 43200.0), ("90", 90.0), ("2w", 1209600.0)])
def test_durations(text: str, seconds: float) -> None:
    from buildvault.config import parse_duration

    assert parse_duration(text) == seconds


async def test_a_data_dir_with_uri_characters_is_read(tmp_path) -> None:
    recorder = Recorder(tmp_path / "odd ?#% dir" / "h.sqlite", clock=lambda: 2.0)
    await recorder.start()
    recorder.record("grpc", "ac_get", "", "ab/3", "hit", "OK", 0, 1.0, 0.0, _meta())
    await recorder.flush()
    assert [r.outcome for r in recorder.store.requests_for("ab/3")] == ["hit"]
    await recorder.close()
