"""Local execution (`--local-workers`): the in-process priority queue and the server's own worker
processes; one implementation of execution.queue.JobQueue.

- queue.py      LocalQueue: dedup of identical in-flight actions, grace and cancel
- scheduler.py  the priority queue, matching workers, requeue of a lost worker's job
- workers.py    the worker processes, fed job frames on stdin (execution.wire)
"""
