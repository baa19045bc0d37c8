"""The upload journal's files: batch file names, the line format of an entry, durable writes.

Why apart from the journal: the format is what must stay readable across versions and crashes
(journal.py describes the layout); the journal's queueing and draining can change freely.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from buildvault.digest import Digest, DigestFunction

CAS = "cas"
AC = "ac"


@dataclass(frozen=True, slots=True)
class JournalEntry:
    kind: str  # CAS or AC
    digest: Digest
    namespace: str | None  # action entries only
    name: str  # "{seq}:{index}": unique in the journal
    seq: int  # the batch: wall-clock nanoseconds of its commit

    @property
    def added(self) -> float:
        """Wall-clock time (seconds) the entry was committed."""
        return self.seq / 1e9


def batch_name(seq: int, count: int) -> str:
    return f"{seq:020d}-{count}.jnl"


def parse_batch_name(name: str) -> tuple[int, int] | None:
    stem, dot, ext = name.partition(".")
    seq, dash, count = stem.partition("-")
    if ext != "jnl" or not dash or not seq.isdigit() or not count.isdigit() or int(count) == 0:
        return None
    return int(seq), int(count)


def record_of(kind: str, digest: Digest, namespace: str | None) -> list[Any]:
    if kind == CAS:
        return ["c", digest.function.label, digest.hash, digest.size_bytes]
    return ["a", digest.function.label, digest.hash, digest.size_bytes, namespace]


def entry_of(record: list[Any], seq: int, index: int) -> JournalEntry:
    tag, label, hash_, size = record[0], record[1], record[2], record[3]
    digest = Digest.parse(hash_, size, DigestFunction.from_label(label))
    if tag == "c" and len(record) == 4:
        return JournalEntry(CAS, digest, None, f"{seq}:{index}", seq)
    if tag == "a" and len(record) == 5 and isinstance(record[4], str):
        return JournalEntry(AC, digest, record[4], f"{seq}:{index}", seq)
    raise ValueError(f"unknown journal record {record!r}")


def write_batch_file(path: Path, records: list[list[Any]]) -> None:
    """Write `records` as JSON lines to a temporary file, fsync it and rename it to `path`."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_lines(path: Path) -> list[str]:
    """The non-empty lines of a batch file."""
    with open(path, encoding="utf-8") as f:
        return [line for line in f.read().split("\n") if line]
