"""Redis mode (`--queue redis://`): jobs in Redis Streams for `buildvault worker`s on any machine,
and the state every server shares; one implementation of execution.queue.JobQueue.

- queue.py      RedisQueue: what the executor calls (dedup across servers, cancel, grace)
- scheduler.py  jobs into the streams, the workers' `started` / `result` messages back
- state.py      job and operation state, the in-flight index (Lua scripts for the races)
- jobs.py       owned jobs published in order, other servers' jobs followed as copies
- keys.py       every Redis key and stream, the priority bands (docs/execution.md)
- worker.py     `buildvault worker`: leases, XAUTOCLAIM, heartbeats of the servers
"""
