"""The Redis keys and message fields the scale-out queue uses, shared by servers and workers.

- `bv:jobs:<platform>`   one stream per requirement set (`any` when empty), consumer group
                          `workers`; an entry carries a job frame and the submitting server's id
- `bv:platforms`         the set of requirement sets that have a stream
- `bv:results:<server>`  a server's stream of `started` and `result` messages from workers
- `bv:cancel`            a stream of job ids to stop; every worker follows it
- `bv:workers`           hash: worker name -> JSON {properties, seen}; stale entries ignored
- `bv:owners`            hash: job entry id -> the worker running it (named when it is lost)
"""

from __future__ import annotations

JOBS = "bv:jobs:"
PLATFORMS = "bv:platforms"
RESULTS = "bv:results:"
CANCEL = "bv:cancel"
WORKERS = "bv:workers"
OWNERS = "bv:owners"
GROUP = "workers"
# A worker unseen for this long no longer counts as offering its platform.
WORKER_STALE = 30.0
# Runs of one job before it ends UNAVAILABLE (a lost worker's job is claimed by another).
MAX_DELIVERIES = 3


def jobs_stream(platform: str) -> str:
    return JOBS + (platform or "any")


def platform_of(stream: str) -> str:
    name = stream[len(JOBS):]
    return "" if name == "any" else name
