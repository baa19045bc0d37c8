"""The boto3 side of the object store: the S3 client's configuration and the thread pool its
blocking calls run in (never on the event loop).

Why apart from the store: both are about running botocore safely (timeouts, retries, checksum
modes that S3-compatibles accept, daemon threads that never hold up exit), not about keys or
verification.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import boto3
import botocore.config

if TYPE_CHECKING:
    from buildvault.config import Settings


def make_s3_client(
    settings: Settings,
    *,
    max_pool_connections: int = 32,
    connect_timeout: float = 5.0,
    read_timeout: float = 30.0,
    max_attempts: int = 3,
    session: boto3.session.Session | None = None,
) -> Any:
    """A botocore S3 client from Settings. Credentials come from the standard AWS chain
    (environment, shared config/credentials files, AWS_PROFILE, instance/container roles).

    Checksums default to "when_required" both ways: boto3 >= 1.36 otherwise sends CRC32 trailer
    headers (aws-chunked, STREAMING-UNSIGNED-PAYLOAD-TRAILER) that Huawei OBS and other
    S3-compatibles reject with XAmzContentSHA256Mismatch. We verify content ourselves."""
    session = session or boto3.session.Session()
    checksums: Any = settings.s3_checksums  # validated by Settings: one of botocore's two literals
    config = botocore.config.Config(
        region_name=settings.s3_region or None,
        signature_version="s3v4",
        s3={"addressing_style": cast(Any, settings.s3_addressing)},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"mode": "standard", "total_max_attempts": max(1, max_attempts)},
        max_pool_connections=max_pool_connections,
        tcp_keepalive=True,
        request_checksum_calculation=checksums,
        response_checksum_validation=checksums,
    )
    return session.client("s3", endpoint_url=settings.s3_endpoint or None, config=config)


class DaemonThreadPool(concurrent.futures.Executor):
    """A thread pool of daemon threads (for `loop.run_in_executor`).

    ThreadPoolExecutor's threads are joined at interpreter exit, whatever `shutdown(wait=False)`
    said: a boto3 call blocked on a bucket that accepts connections and never answers kept a
    stopped server alive for read_timeout x attempts (~90 s), past any supervisor's grace period.
    Threads start on demand (up to `max_workers`) and idle ones are reused."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "pool") -> None:
        self._max_workers = max(1, max_workers)
        self._prefix = thread_name_prefix
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._worker, name=f"{self._prefix}_{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
            return future

    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:  # shut down: pass it on to the next worker
                self._work.put(None)
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    future.set_exception(exc)
                    del exc
                else:
                    future.set_result(result)
                    del result
            del future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._shutdown:
                self._shutdown = True
                if cancel_futures:
                    while True:
                        try:
                            item = self._work.get_nowait()
                        except queue.Empty:
                            break
                        if item is not None:
                            item[0].cancel()
                self._work.put(None)
        if wait:
            for thread in self._threads:
                thread.join()
