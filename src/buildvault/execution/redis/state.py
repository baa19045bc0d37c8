"""Operation state and the in-flight index in Redis (`--queue redis://`), shared by every server.

The server that queued a job (its owner) publishes each change of it: the `bv:job:<id>` hash
and an entry on `bv:events`, which every server follows to keep its copies (`Job.owned` False)
of jobs owned elsewhere current. Operations are hashes too, so WaitExecution, GetOperation and
CancelOperation work on any server. `ops` counts the live operations of a job on all servers;
when it drops to 0 the job is cancelled (the Lua scripts keep the count and the in-flight index
consistent when two servers race). Every key has a TTL: nothing outlives its use for long.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from buildvault.digest import Digest, DigestFunction
from buildvault.execution.redis import keys
from buildvault.remote_apis import re_pb2

# A job's state lives at least as long as it could run (the maximum timeout is 2 h) plus queueing.
JOB_TTL = 4 * 3600
EVENTS_MAXLEN = 100_000

# Add one live operation to a job that is still running, not cancelled, and whose owner is alive;
# its state, or nil.
_JOIN = """
if redis.call('exists', KEYS[1]) == 0 then return nil end
local state = redis.call('hmget', KEYS[1], 'seq', 'stage', 'worker', 'done', 'cancelled', 'ops', 'owner')
if state[4] == '1' or state[5] == '1' or tonumber(state[6] or '0') <= 0 then return nil end
if not state[7] or redis.call('exists', ARGV[1] .. state[7]) == 0 then return nil end
redis.call('hincrby', KEYS[1], 'ops', 1)
return {state[1], state[2], state[3]}
"""

# Remove ARGV[1] live operations; at 0 the job is marked cancelled and leaves the in-flight index.
_RELEASE = """
if redis.call('exists', KEYS[1]) == 0 then return 0 end
local left = redis.call('hincrby', KEYS[1], 'ops', -tonumber(ARGV[1]))
if left <= 0 and redis.call('hget', KEYS[1], 'done') ~= '1' then
  redis.call('hset', KEYS[1], 'cancelled', '1')
  local key = redis.call('hget', KEYS[1], 'inflight')
  if key and redis.call('get', key) == ARGV[2] then redis.call('del', key) end
end
return left
"""

# Delete the in-flight entry KEYS[1] only while it still names job ARGV[1].
_FORGET = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class JobState:
    seq: int
    stage: int
    worker: str
    response: re_pb2.ExecuteResponse | None
    # The server that queued it stopped (its heartbeat expired) before it finished.
    owner_gone: bool = False

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes], owner_gone: bool = False) -> JobState:
        response = None
        if fields.get(b"done") == b"1":
            response = re_pb2.ExecuteResponse()
            response.ParseFromString(fields.get(b"response", b""))
        return cls(
            seq=int(fields.get(b"seq", b"0")),
            stage=int(fields.get(b"stage", b"0")),
            worker=fields.get(b"worker", b"").decode(),
            response=response,
            owner_gone=owner_gone and response is None,
        )


@dataclass(frozen=True)
class OperationRecord:
    name: str
    action_digest: Digest
    job_id: str
    response: re_pb2.ExecuteResponse | None


def in_flight_key(dedup_key: tuple[str, str]) -> str:
    instance, action = dedup_key
    return f"{keys.IN_FLIGHT}{instance}:{action}"


class SharedState:
    def __init__(self, redis: Any, keep_finished: float) -> None:
        self.redis = redis
        self.keep_finished = int(keep_finished)
        self._join = redis.register_script(_JOIN)
        self._release = redis.register_script(_RELEASE)
        self._forget = redis.register_script(_FORGET)

    # -- jobs -----------------------------------------------------------------------------

    async def heartbeat(self, server_id: str) -> None:
        await self.redis.set(keys.SERVER + server_id, 1, ex=keys.SERVER_TTL)

    async def stop_heartbeat(self, server_id: str) -> None:
        await self.redis.delete(keys.SERVER + server_id)

    async def create_job(
        self,
        job_id: str,
        dedup_key: tuple[str, str] | None,
        owner: str,
        operation: tuple[str, Digest] | None = None,
    ) -> bool:
        """The owner's first record of a job (one live operation, its own), its `operation`, and
        the claim of the in-flight index, in one round trip. False: another job holds the index
        (see `claim_in_flight`)."""
        fields = {"seq": 0, "stage": re_pb2.ExecutionStage.QUEUED, "worker": "", "ops": 1, "done": 0, "cancelled": 0,
                  "owner": owner}  # fmt: skip
        if dedup_key is not None:
            fields["inflight"] = in_flight_key(dedup_key)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.JOB + job_id, mapping=fields)
            pipe.expire(keys.JOB + job_id, JOB_TTL)
            if operation is not None:
                self._operation(pipe, operation[0], operation[1], job_id, None)
            if dedup_key is not None:
                pipe.set(in_flight_key(dedup_key), job_id, nx=True, ex=JOB_TTL)
            answers = await pipe.execute()
        return dedup_key is None or bool(answers[-1])

    async def claim_in_flight(self, dedup_key: tuple[str, str], job_id: str) -> str | None:
        """Make `job_id` the in-flight job of its action; the id of the one already there, if any."""
        key = in_flight_key(dedup_key)
        if await self.redis.set(key, job_id, nx=True, ex=JOB_TTL):
            return None
        current = await self.redis.get(key)
        if current is not None and current.decode() == job_id:
            return None
        return current.decode() if current is not None else None

    async def take_over_in_flight(self, dedup_key: tuple[str, str], job_id: str) -> None:
        """The job the index named has ended or was cancelled: `job_id` replaces it."""
        await self.redis.set(in_flight_key(dedup_key), job_id, ex=JOB_TTL)

    async def join(self, job_id: str) -> JobState | None:
        """One more live operation on `job_id`, or None when it is gone, done or cancelled."""
        state = await self._join(keys=[keys.JOB + job_id], args=[keys.SERVER])
        if state is None:
            return None
        seq, stage, worker = state
        return JobState(int(seq), int(stage), (worker or b"").decode(), None)

    async def drop_job(self, job_id: str) -> None:
        await self.redis.delete(keys.JOB + job_id)

    async def release(self, job_id: str, count: int) -> int:
        """`count` fewer live operations; what is left (<= 0: the job is now marked cancelled)."""
        return int(await self._release(keys=[keys.JOB + job_id], args=[count, job_id]))

    async def add_operation(self, job_id: str) -> None:
        await self.redis.hincrby(keys.JOB + job_id, "ops", 1)

    async def publish(self, job_id: str, state: JobState, dedup_key: tuple[str, str] | None = None) -> None:
        """The owner's change of a job: its hash, the event the other servers follow and, once
        done (after the ActionCache write), its leaving the in-flight index."""
        fields: dict[str, Any] = {"seq": state.seq, "stage": state.stage, "worker": state.worker}
        if state.response is not None:
            fields.update(done=1, response=state.response.SerializeToString())
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.JOB + job_id, mapping=fields)
            pipe.expire(keys.JOB + job_id, self.keep_finished if state.response is not None else JOB_TTL)
            pipe.xadd(keys.EVENTS, {"id": job_id, **fields}, maxlen=EVENTS_MAXLEN, approximate=True)
            if state.response is not None and dedup_key is not None:
                await self._forget(keys=[in_flight_key(dedup_key)], args=[job_id], client=pipe)
            await pipe.execute()

    async def job_state(self, job_id: str) -> JobState | None:
        fields = await self.redis.hgetall(keys.JOB + job_id)
        if not fields:
            return None
        owner = fields.get(b"owner", b"").decode()
        alive = bool(owner) and bool(await self.redis.exists(keys.SERVER + owner))
        return JobState.from_fields(fields, owner_gone=not alive)

    async def is_cancelled(self, job_id: str) -> bool:
        return bool(await self.redis.hget(keys.JOB + job_id, "cancelled") == b"1")

    async def read_events(
        self, last: str, block_ms: int
    ) -> tuple[str, list[tuple[str, JobState]], list[str]]:
        """Job changes and cancelled operation names after entry `last` ("$": from now), waiting up
        to `block_ms` for the first."""
        answer = await self.redis.xread({keys.EVENTS: last}, block=block_ms, count=500)
        events = []
        cancelled = []
        for _, entries in answer or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                if b"cancel" in fields:
                    cancelled.append(fields[b"cancel"].decode())
                else:
                    events.append((fields[b"id"].decode(), JobState.from_fields(fields)))
        return last, events, cancelled

    async def announce_cancel(self, name: str) -> None:
        """Tell every server that operation `name` was cancelled (its own server ends its streams)."""
        await self.redis.xadd(keys.EVENTS, {"cancel": name}, maxlen=EVENTS_MAXLEN, approximate=True)

    async def last_event(self) -> str:
        """The id of the newest event (where a reader that must miss nothing starts)."""
        entries = await self.redis.xrevrange(keys.EVENTS, count=1)
        return entries[0][0].decode() if entries else "0-0"

    # -- operations -----------------------------------------------------------------------

    async def save_operation(
        self, name: str, action_digest: Digest, job_id: str, response: re_pb2.ExecuteResponse | None
    ) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            self._operation(pipe, name, action_digest, job_id, response)
            await pipe.execute()

    def _operation(
        self, pipe: Any, name: str, action_digest: Digest, job_id: str, response: re_pb2.ExecuteResponse | None
    ) -> None:
        fields: dict[str, Any] = {"action": f"{action_digest.hash}/{action_digest.size_bytes}", "job": job_id}
        if response is not None:
            fields["response"] = response.SerializeToString()
        pipe.hset(keys.OPERATION + name, mapping=fields)
        pipe.expire(keys.OPERATION + name, self.keep_finished if response is not None else JOB_TTL)

    async def operation_names(self) -> list[str]:
        """Every live operation's name, on every server (a SCAN: for listings, not hot paths)."""
        return [key.decode()[len(keys.OPERATION) :] async for key in self.redis.scan_iter(keys.OPERATION + "*", 1000)]

    async def load_operation(self, name: str) -> OperationRecord | None:
        fields = await self.redis.hgetall(keys.OPERATION + name)
        if not fields:
            return None
        hash_, _, size = fields[b"action"].decode().partition("/")
        response = None
        if b"response" in fields:
            response = re_pb2.ExecuteResponse()
            response.ParseFromString(fields[b"response"])
        return OperationRecord(
            name=name,
            action_digest=Digest(hash_, int(size), DigestFunction.SHA256),
            job_id=fields.get(b"job", b"").decode(),
            response=response,
        )
