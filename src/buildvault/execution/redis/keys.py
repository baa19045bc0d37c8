"""The Redis keys and message fields the scale-out queue uses, shared by servers and workers.

- `bv:jobs:<band>:<platform>`  one stream per priority band and requirement set (`any` when
                          empty), consumer group `workers`; an entry carries a job frame and the
                          submitting server's id. Workers read band 0 (most urgent) first.
- `bv:platforms`         the set of requirement sets that have streams
- `bv:results:<server>`  a server's stream of `started` and `result` messages from workers
- `bv:cancel`            a stream of job ids to stop; every worker follows it
- `bv:workers`           hash: worker name -> JSON {properties, seen}; stale entries ignored
- `bv:owners`            hash: job entry id -> the worker running it (named when it is lost)
- `bv:job:<id>`          hash: a job's shared state (execution.redis.state): seq, stage, worker,
                          response, ops (live operations on every server), cancelled, inflight
- `bv:op:<name>`         hash: an operation: its job id, action digest, or its own response
- `bv:inflight:<instance>:<action>`  the id of the job running that action (dedup across servers)
- `bv:events`            a stream of job state changes every server follows (capped)
- `bv:server:<id>`       a server's heartbeat (short TTL): the jobs it owns are alive
"""

from __future__ import annotations

JOBS = "bv:jobs:"
PLATFORMS = "bv:platforms"
RESULTS = "bv:results:"
CANCEL = "bv:cancel"
WORKERS = "bv:workers"
OWNERS = "bv:owners"
JOB = "bv:job:"
OPERATION = "bv:op:"
IN_FLIGHT = "bv:inflight:"
EVENTS = "bv:events"
SERVER = "bv:server:"
# A server's heartbeat lasts this long, refreshed three times as often.
SERVER_TTL = 15
GROUP = "workers"
# A worker unseen for this long no longer counts as offering its platform.
WORKER_STALE = 30.0
# Runs of one job before it ends UNAVAILABLE (a lost worker's job is claimed by another).
MAX_DELIVERIES = 3


# ExecutionPolicy.priority (lower is more urgent) -> band: the first bound it does not exceed.
# Band 0 (priority <= -100) is read first, band 4 (priority > 99) last.
BAND_BOUNDS = (-100, -1, 0, 99)
BANDS = len(BAND_BOUNDS) + 1


def band_of(priority: int) -> int:
    for band, bound in enumerate(BAND_BOUNDS):
        if priority <= bound:
            return band
    return BANDS - 1


def jobs_stream(platform: str, band: int) -> str:
    return f"{JOBS}{band}:{platform or 'any'}"
