"""A real S3-compatible server (moto) on loopback for the tests, and helpers around it.

Two ways to run it, one set of helpers:

- `s3_endpoint` (module fixture): moto's ThreadedMotoServer in this process. Fast; tests may
  seed its state directly (`moto.s3.models.s3_backends`). For the storage-layer tests.
- `moto_server` (module fixture): a `moto_server` subprocess (`MotoServer`) on a free port,
  which a test can kill (every connection cut) and start again on the same port, empty: a
  restarted moto has no buckets until one is created again; or freeze (SIGSTOP: a hung bucket
  that takes connections and never answers) and thaw with its state intact. For the
  server-level tests.

Both set the AWS environment (fake credentials, no profile or metadata lookups) for the module,
so boto3 here and every `buildvault serve` subprocess started from the tests find the same
credentials through the standard chain. Import the fixtures into a test module
(`from s3_server import bucket, s3_endpoint  # noqa: F401`) and the helpers by name.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import botocore.config
import pytest
from polling import wait_for

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
_AWS_UNSET = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_REQUEST_CHECKSUM_CALCULATION")
REGION = "us-east-1"
START_TIMEOUT = 30.0

SESSION: list[boto3.session.Session] = []


def session() -> boto3.session.Session:
    """One boto3 session per process: a new session reloads the S3 model (~0.3 s)."""
    if not SESSION:
        SESSION.append(boto3.session.Session())
    return SESSION[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_client(endpoint: str, **config: object):
    """A plain boto3 S3 client on the endpoint (what an operator or another tool would use)."""
    options = dict(request_checksum_calculation="when_required", response_checksum_validation="when_required")
    options.update(config)
    return session().client("s3", endpoint_url=endpoint, region_name=REGION, config=botocore.config.Config(**options))


def create_bucket(endpoint: str, name: str | None = None) -> str:
    name = name or f"bv-{uuid.uuid4().hex[:12]}"
    raw_client(endpoint).create_bucket(Bucket=name)
    return name


def bucket_keys(endpoint: str, bucket: str) -> set[str]:
    s3 = raw_client(endpoint)
    keys: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys |= {o["Key"] for o in page.get("Contents", [])}
    return keys


def put_objects(endpoint: str, bucket: str, objects: dict[str, bytes], workers: int = 16) -> None:
    """PUT many objects concurrently (seeding a bucket over HTTP)."""
    s3 = raw_client(endpoint, max_pool_connections=workers)
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda item: s3.put_object(Bucket=bucket, Key=item[0], Body=item[1]), objects.items()))


@pytest.fixture(scope="module")
def aws_env() -> Iterator[dict[str, str]]:
    """The fake AWS credentials in os.environ for the module (inherited by subprocesses)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in AWS_ENV.items():
            mp.setenv(key, value)
        for key in _AWS_UNSET:
            mp.delenv(key, raising=False)
        yield dict(AWS_ENV)


@pytest.fixture(scope="module")
def s3_endpoint(aws_env) -> Iterator[str]:
    """moto's ThreadedMotoServer in this process, for the module; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def bucket(s3_endpoint) -> str:
    """A fresh bucket in the in-process moto server."""
    return create_bucket(s3_endpoint)


class MotoServer:
    """`moto_server` as a subprocess on 127.0.0.1; kill() cuts every connection, start() again
    reuses the port (and starts empty)."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = Path(log_path)
        self.process: subprocess.Popen[bytes] | None = None
        self.frozen = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def freeze(self) -> None:
        """SIGSTOP: a hung bucket. The kernel still accepts connections (the listen backlog) and
        takes requests in, but nothing answers until thaw(); open connections stay open."""
        if self.running:
            assert self.process is not None
            self.process.send_signal(signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        """SIGCONT: the bucket answers again, with its state intact."""
        if self.process is not None and self.frozen:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGCONT)
            self.frozen = False

    def start(self, timeout: float = START_TIMEOUT) -> MotoServer:
        self.thaw()  # a test that failed while the bucket was frozen left it so
        if self.running:
            return self
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"moto_server on port {self.port} did not start; see {self.log_path}")
            time.sleep(0.05)  # polling readiness, bounded by the deadline
        return self

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL: the S3 server vanishes mid-request; its state is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        self.thaw()  # a stopped process would not act on SIGTERM
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def moto_server(tmp_path_factory, aws_env) -> Iterator[MotoServer]:
    """A `moto_server` subprocess for the module; restarted if a test left it stopped."""
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def s3(moto_server) -> MotoServer:
    """The module's moto subprocess, running (started again if a previous test stopped it)."""
    return moto_server.start()


# -- a buildvault server on the bucket -----------------------------------------------------------


# moto answers one request at a time: on a loaded machine a burst of HEADs (a Bazel build's
# FindMissingBlobs) takes seconds, which the default request budget (0.3 s) would rightly treat
# as a slow bucket. Tests of that budget pass their own `--s3-request-budget` after these flags.
TEST_SERVER_BUDGET = "10"


def tier_args(endpoint: str, bucket: str, *extra: str) -> list[str]:
    """`buildvault serve` flags for the object tier on `bucket` at `endpoint` (later flags win)."""
    return [
        "--s3-endpoint", endpoint, "--s3-bucket", bucket, "--s3-region", REGION,
        "--s3-request-budget", TEST_SERVER_BUDGET, *extra,
    ]  # fmt: skip


def scrape(http_address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The server's /metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(http_address: str, name: str, **labels: str) -> float | None:
    return scrape(http_address).get((name, tuple(sorted(labels.items()))))


def s3_requests(http_address: str) -> dict[str, float]:
    """Object-store API calls so far, by operation (`head`, `get`, `put`, ...)."""
    return {
        dict(labels)["operation"]: value
        for (name, labels), value in scrape(http_address).items()
        if name == "buildvault_object_store_requests_total"
    }


def wait_drained(http_address: str, timeout: float = 60.0) -> None:
    """Until the server's upload journal is empty (everything it accepted is in the bucket)."""
    wait_for(
        lambda: metric(http_address, "buildvault_upload_journal_backlog") == 0,
        timeout,
        f"the upload journal of {http_address} to drain",
    )
