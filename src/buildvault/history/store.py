"""The history database: one SQLite file in WAL mode (standard library `sqlite3`).

Written by one thread only (the recorder's), in batches of one transaction; read by the build
pages from other connections (WAL lets readers run beside the writer). Two tables carry it:
`requests`, one row per recorded call (ActionCache lookup or update, Execute, ByteStream
transfer) with its RequestMetadata, outcome and timing, and `invocations`, one row per
`tool_invocation_id` with running totals (kept in the same transaction as the rows, so the
invocation list never scans `requests`). `build_events` keeps what a Build Event Protocol
stream said about an invocation.

Retention: rows older than the retention age go, then the oldest rows until the live pages fit
the size cap; `auto_vacuum=INCREMENTAL` hands the freed pages back to the file system.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

__all__ = ["OUTCOMES", "HistoryStore", "InvocationDetail", "InvocationSummary", "Row"]

# What a recorded call came to.
OUTCOMES = ("hit", "miss", "upload", "executed", "failed", "download")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    duration REAL NOT NULL,
    protocol TEXT NOT NULL,
    method TEXT NOT NULL,
    instance TEXT NOT NULL,
    digest TEXT NOT NULL,
    outcome TEXT NOT NULL,
    code TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    invocation TEXT NOT NULL,
    correlated TEXT NOT NULL,
    action_id TEXT NOT NULL,
    mnemonic TEXT NOT NULL,
    target TEXT NOT NULL,
    configuration TEXT NOT NULL,
    tool TEXT NOT NULL,
    tool_version TEXT NOT NULL,
    malformed INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_invocation ON requests(invocation);
CREATE INDEX IF NOT EXISTS requests_digest ON requests(digest);
CREATE INDEX IF NOT EXISTS requests_target ON requests(target);
CREATE TABLE IF NOT EXISTS invocations (
    id TEXT PRIMARY KEY,
    instance TEXT NOT NULL,
    tool TEXT NOT NULL,
    tool_version TEXT NOT NULL,
    correlated TEXT NOT NULL,
    first REAL NOT NULL,
    last REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    misses INTEGER NOT NULL DEFAULT 0,
    uploads INTEGER NOT NULL DEFAULT 0,
    executed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    bytes_up INTEGER NOT NULL DEFAULT 0,
    bytes_down INTEGER NOT NULL DEFAULT 0,
    requests INTEGER NOT NULL DEFAULT 0,
    command TEXT NOT NULL DEFAULT '',
    patterns TEXT NOT NULL DEFAULT '',
    options TEXT NOT NULL DEFAULT '',
    exit_code INTEGER,
    exit_name TEXT NOT NULL DEFAULT '',
    bes_started REAL,
    bes_finished REAL
);
CREATE INDEX IF NOT EXISTS invocations_last ON invocations(last);
CREATE TABLE IF NOT EXISTS build_events (
    id INTEGER PRIMARY KEY,
    invocation TEXT NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    label TEXT NOT NULL,
    status TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS build_events_invocation ON build_events(invocation);
"""

_INSERT = (
    "INSERT INTO requests (time, duration, protocol, method, instance, digest, outcome, code, bytes, invocation,"
    " correlated, action_id, mnemonic, target, configuration, tool, tool_version, malformed)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_UPSERT = (
    "INSERT INTO invocations (id, instance, tool, tool_version, correlated, first, last, hits, misses, uploads,"
    " executed, failed, bytes_up, bytes_down, requests) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT(id) DO UPDATE SET first = min(first, excluded.first), last = max(last, excluded.last),"
    " hits = hits + excluded.hits, misses = misses + excluded.misses, uploads = uploads + excluded.uploads,"
    " executed = executed + excluded.executed, failed = failed + excluded.failed,"
    " bytes_up = bytes_up + excluded.bytes_up, bytes_down = bytes_down + excluded.bytes_down,"
    " requests = requests + excluded.requests"
)
# Columns of a `requests` row, in the order of _INSERT (a recorded call is a tuple in this order).
COLUMNS = (
    "time", "duration", "protocol", "method", "instance", "digest", "outcome", "code", "bytes", "invocation",
    "correlated", "action_id", "mnemonic", "target", "configuration", "tool", "tool_version", "malformed",
)  # fmt: skip
_UPLOADING = frozenset({"ac_update", "write"})


@dataclass(frozen=True, slots=True)
class Row:
    """One recorded call, as the pages read it."""

    time: float
    duration: float
    protocol: str
    method: str
    instance: str
    digest: str
    outcome: str
    code: str
    bytes: int
    invocation: str
    correlated: str
    action_id: str
    mnemonic: str
    target: str
    configuration: str
    tool: str
    tool_version: str
    malformed: int


@dataclass(frozen=True, slots=True)
class InvocationSummary:
    id: str
    instance: str
    tool: str
    tool_version: str
    correlated: str
    first: float
    last: float
    hits: int
    misses: int
    uploads: int
    executed: int
    failed: int
    bytes_up: int
    bytes_down: int
    requests: int
    command: str
    patterns: str
    options: str
    exit_code: int | None
    exit_name: str
    bes_started: float | None
    bes_finished: float | None

    @property
    def outcome(self) -> str:
        """'failed' (the build said so, or a recorded call failed), 'running' (BES begun, not
        finished), else 'ok'."""
        if (self.exit_code is not None and self.exit_code != 0) or self.failed:
            return "failed"
        if self.bes_started is not None and self.bes_finished is None:
            return "running"
        return "ok"


@dataclass(frozen=True, slots=True)
class InvocationDetail:
    """The invocation page's tables: (name, hits, misses, executed, failed) by mnemonic and by target
    (most misses first), the slowest and the failed calls, and every missed digest once with its
    mnemonic and target, in the order they missed."""

    by_mnemonic: list[tuple[str, int, int, int, int]]
    by_target: list[tuple[str, int, int, int, int]]
    slowest: list[Row]
    failed: list[Row]
    misses: list[tuple[str, str, str]]


_ROW_SELECT = "SELECT " + ", ".join(COLUMNS) + " FROM requests"
_INVOCATION_SELECT = (
    "SELECT id, instance, tool, tool_version, correlated, first, last, hits, misses, uploads, executed, failed,"
    " bytes_up, bytes_down, requests, command, patterns, options, exit_code, exit_name, bes_started, bes_finished"
    " FROM invocations"
)


def connect(path: Path) -> sqlite3.Connection:
    """A connection in WAL mode that waits up to 5 s for another writer (another server process)."""
    connection = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    return connection


class HistoryStore:
    """The database at `path`. Writer methods belong to one thread; readers open their own
    connection per call (cheap beside the query, and safe from any thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: sqlite3.Connection | None = None

    # -- writing (one thread) ---------------------------------------------------------------

    def open(self) -> None:
        """Create or open the file and its schema (raises sqlite3.Error when it cannot)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, timeout=5.0, isolation_level=None, check_same_thread=False)
        # Only takes effect on a new file (before the first table); later it is a no-op.
        connection.execute("PRAGMA auto_vacuum=INCREMENTAL")
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.executescript(_SCHEMA)
        self._writer = connection

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _connection(self) -> sqlite3.Connection:
        if self._writer is None:
            self.open()
        assert self._writer is not None
        return self._writer

    def write(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Insert `rows` (tuples in COLUMNS order) and fold them into their invocations' totals,
        in one transaction."""
        if not rows:
            return
        totals: dict[str, list[Any]] = {}
        for n, row in enumerate(rows, 1):
            if n % 32 == 0:
                time.sleep(0)  # let the event loop's thread have the GIL (recorder.YIELD_EVERY)
            invocation = row[9]
            if not invocation:
                continue
            t = totals.get(invocation)
            if t is None:
                # id, instance, tool, tool_version, correlated, first, last, hits .. requests
                t = totals[invocation] = [invocation, row[4], row[15], row[16], row[10], row[0], row[0]] + [0] * 8
            t[5] = min(t[5], row[0])
            t[6] = max(t[6], row[0] + row[1])
            outcome = row[6]
            if outcome == "hit":
                t[7] += 1
            elif outcome == "miss":
                t[8] += 1
            elif outcome == "upload" and row[3] == "ac_update":
                t[9] += 1
            elif outcome == "executed":
                t[10] += 1
            elif outcome == "failed":
                t[11] += 1
            if row[3] in _UPLOADING:
                t[12] += row[8]
            else:
                t[13] += row[8]
            t[14] += 1
        connection = self._connection()
        connection.execute("BEGIN")
        try:
            connection.executemany(_INSERT, rows)
            connection.executemany(_UPSERT, totals.values())
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:  # SQLite rolls some errors (a full disk) back itself
                connection.execute("ROLLBACK")
            raise

    def write_events(self, events: Sequence[tuple[str, float, str, str, str, str]]) -> None:
        """Build events: (invocation, time, kind, label, status, detail)."""
        connection = self._connection()
        connection.execute("BEGIN")
        try:
            connection.executemany(
                "INSERT INTO build_events (invocation, time, kind, label, status, detail) VALUES (?, ?, ?, ?, ?, ?)",
                events,
            )
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:  # SQLite rolls some errors (a full disk) back itself
                connection.execute("ROLLBACK")
            raise

    def update_invocation(self, invocation: str, instance: str, at: float, **fields: Any) -> None:
        """Set BES-known fields of an invocation (command, patterns, options, exit_code, exit_name,
        bes_started, bes_finished), creating its row if no call was recorded yet."""
        allowed = {"command", "patterns", "options", "exit_code", "exit_name", "bes_started", "bes_finished", "tool"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown invocation fields {sorted(unknown)}")
        connection = self._connection()
        connection.execute("BEGIN")
        try:
            connection.execute(
                "INSERT INTO invocations (id, instance, tool, tool_version, correlated, first, last)"
                " VALUES (?, ?, '', '', '', ?, ?) ON CONFLICT(id) DO UPDATE SET"
                " first = min(first, excluded.first), last = max(last, excluded.last)",
                (invocation, instance, at, at),
            )
            if fields:
                assignments = ", ".join(f"{name} = ?" for name in fields)
                connection.execute(f"UPDATE invocations SET {assignments} WHERE id = ?", (*fields.values(), invocation))
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:  # SQLite rolls some errors (a full disk) back itself
                connection.execute("ROLLBACK")
            raise

    def live_bytes(self) -> int:
        """Bytes of the pages in use (the file minus its free pages)."""
        connection = self._connection()
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
        pages = connection.execute("PRAGMA page_count").fetchone()[0]
        free = connection.execute("PRAGMA freelist_count").fetchone()[0]
        return int((pages - free) * page_size)

    def _first_id_at(self, cutoff: float) -> int:
        """The smallest rowid whose row is at or after `cutoff` (one past the last row if none)."""
        connection = self._connection()
        low, high = connection.execute("SELECT min(id), max(id) FROM requests").fetchone()
        if low is None:
            return 0
        high += 1
        while low < high:
            middle = (low + high) // 2
            row = connection.execute("SELECT id, time FROM requests WHERE id >= ? ORDER BY id LIMIT 1",
                                     (middle,)).fetchone()  # fmt: skip
            if row is None or row[1] >= cutoff:
                high = middle if row is None else min(middle, row[0])
            else:
                low = row[0] + 1
        return int(low)

    def prune(self, now: float, max_age: float, max_bytes: int) -> int:
        """Drop rows older than `max_age` seconds, then the oldest until the pages in use fit
        `max_bytes` (to 90 % of it, so pruning is not redone at every write); returns rows dropped."""
        connection = self._connection()
        cutoff = now - max_age
        # Rows are appended in time order (give or take one batch), so the rowid orders them:
        # no index on time to keep up at every insert; the first row at or after the cutoff is
        # found by bisection over rowids.
        edge_id = self._first_id_at(cutoff)
        dropped = connection.execute("DELETE FROM requests WHERE id < ?", (edge_id,)).rowcount
        connection.execute("DELETE FROM invocations WHERE last < ?", (cutoff,))
        connection.execute("DELETE FROM build_events WHERE time < ?", (cutoff,))
        rounds = 0
        while max_bytes > 0 and self.live_bytes() > max_bytes and rounds < 64:
            rounds += 1
            total = connection.execute("SELECT count(*) FROM requests").fetchone()[0]
            if total == 0:
                break
            target = 0.9 * max_bytes
            share = max(1, int(total * (1 - target / max(self.live_bytes(), 1))) + 1)
            edge_id, edge = connection.execute(
                "SELECT id, time FROM requests ORDER BY id LIMIT 1 OFFSET ?", (min(share, total) - 1,)
            ).fetchone()
            dropped += connection.execute("DELETE FROM requests WHERE id <= ?", (edge_id,)).rowcount
            connection.execute("DELETE FROM build_events WHERE time <= ?", (edge,))
            connection.execute(
                "DELETE FROM invocations WHERE last <= ? AND id NOT IN (SELECT DISTINCT invocation FROM requests)",
                (edge,),
            )
            connection.execute("PRAGMA incremental_vacuum")
        connection.execute("PRAGMA incremental_vacuum")
        return dropped

    # -- reading (any thread) ---------------------------------------------------------------

    def _reader(self) -> sqlite3.Connection:
        """A read-only connection of its own (the path quoted: a data dir may hold '?' or '#')."""
        uri = f"file:{quote(str(self.path.resolve()))}?mode=ro"
        return sqlite3.connect(uri, uri=True, timeout=5.0, check_same_thread=False)

    def _read(self, sql: str, parameters: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        connection = self._reader()
        try:
            return connection.execute(sql, tuple(parameters)).fetchall()
        finally:
            connection.close()

    def invocations(self, *, instance: str | None = None, limit: int = 200) -> list[InvocationSummary]:
        """The most recent invocations (by last activity), optionally of one instance."""
        if instance is None:
            rows = self._read(_INVOCATION_SELECT + " ORDER BY last DESC LIMIT ?", (limit,))
        else:
            rows = self._read(_INVOCATION_SELECT + " WHERE instance = ? ORDER BY last DESC LIMIT ?", (instance, limit))
        return [InvocationSummary(*row) for row in rows]

    def invocation(self, invocation: str) -> InvocationSummary | None:
        rows = self._read(_INVOCATION_SELECT + " WHERE id = ?", (invocation,))
        return InvocationSummary(*rows[0]) if rows else None

    def requests_of(self, invocation: str) -> list[Row]:
        """Every recorded call of an invocation, in time order."""
        rows = self._read(_ROW_SELECT + " WHERE invocation = ? ORDER BY time", (invocation,))
        return [Row(*row) for row in rows]

    def invocation_detail(self, invocation: str, *, targets: int = 100, slowest: int = 20,
                          failed: int = 500) -> InvocationDetail:  # fmt: skip
        """What the invocation page shows, aggregated by SQLite (one connection, five queries)."""
        looked = "invocation = ? AND method IN ('ac_get', 'execute')"
        connection = self._reader()
        try:
            q = connection.execute
            counts = ("sum(outcome = 'hit'), sum(outcome = 'miss'), sum(outcome = 'executed'),"
                      " sum(outcome = 'failed')")  # fmt: skip
            by_mnemonic = q(f"SELECT mnemonic, {counts} FROM requests WHERE {looked} GROUP BY mnemonic"
                            " ORDER BY mnemonic", (invocation,)).fetchall()  # fmt: skip
            by_target = q(f"SELECT target, {counts} FROM requests WHERE {looked} GROUP BY target"
                          " ORDER BY 3 DESC, target LIMIT ?", (invocation, targets)).fetchall()  # fmt: skip
            slow = q(_ROW_SELECT + f" WHERE {looked} ORDER BY duration DESC LIMIT ?", (invocation, slowest)).fetchall()
            failures = q(_ROW_SELECT + " WHERE invocation = ? AND outcome = 'failed' ORDER BY time LIMIT ?",
                         (invocation, failed)).fetchall()  # fmt: skip
            misses = q("SELECT digest, mnemonic, target FROM requests WHERE invocation = ? AND outcome = 'miss'"
                       " GROUP BY digest ORDER BY min(id)", (invocation,)).fetchall()  # fmt: skip
        finally:
            connection.close()
        return InvocationDetail(
            [(str(m), int(h or 0), int(x or 0), int(e or 0), int(f or 0)) for m, h, x, e, f in by_mnemonic],
            [(str(t), int(h or 0), int(x or 0), int(e or 0), int(f or 0)) for t, h, x, e, f in by_target],
            [Row(*r) for r in slow],
            [Row(*r) for r in failures],
            [(str(d), str(m), str(t)) for d, m, t in misses],
        )

    def requests_for(self, digest: str, limit: int = 200) -> list[Row]:
        """The most recent recorded calls naming an action digest (`hash/size`)."""
        rows = self._read(_ROW_SELECT + " WHERE digest = ? ORDER BY time DESC LIMIT ?", (digest, limit))
        return [Row(*row) for row in rows]

    def same_step(
        self,
        instance: str,
        target: str,
        mnemonic: str,
        before: float,
        *,
        exclude_digest: str,
        exclude_invocation: str = "",
        limit: int = 50,
    ) -> list[tuple[str, str, float]]:
        """Earlier action digests recorded for the same target and mnemonic in other invocations,
        newest first: (digest, invocation, time), one per digest."""
        rows = self._read(
            "SELECT digest, invocation, max(time) FROM requests WHERE instance = ? AND target = ? AND mnemonic = ?"
            " AND time < ? AND digest != ? AND invocation != ? AND method IN ('ac_get', 'ac_update', 'execute')"
            " GROUP BY digest ORDER BY max(time) DESC LIMIT ?",
            (instance, target, mnemonic, before, exclude_digest, exclude_invocation or "\x00", limit),
        )
        return [(str(d), str(i), float(t)) for d, i, t in rows]

    def recent_actions(
        self, instance: str, before: float, *, exclude_digest: str, exclude_invocation: str = "", limit: int = 300
    ) -> list[tuple[str, str, float]]:
        """Earlier action digests of an instance in other invocations, newest first (the search by
        output paths when the client sent no target)."""
        rows = self._read(
            "SELECT digest, invocation, max(time) FROM requests WHERE instance = ? AND time < ? AND digest != ?"
            " AND invocation != ? AND method IN ('ac_get', 'ac_update', 'execute')"
            " GROUP BY digest ORDER BY max(time) DESC LIMIT ?",
            (instance, before, exclude_digest, exclude_invocation or "\x00", limit),
        )
        return [(str(d), str(i), float(t)) for d, i, t in rows]

    def events_of(self, invocation: str) -> list[tuple[float, str, str, str, str]]:
        """Build events of an invocation: (time, kind, label, status, detail)."""
        rows = self._read(
            "SELECT time, kind, label, status, detail FROM build_events WHERE invocation = ? ORDER BY id", (invocation,)
        )
        return [(float(a), str(b), str(c), str(d), str(e)) for a, b, c, d, e in rows]


def now() -> float:
    return time.time()
