"""Start and stop the servers the benchmarks compare: buildvault and BuildGrid, on loopback.

Each server runs in its own session (process group) with its log in a file; `stop()` ends
exactly the process group it started. `cpus` (bench/compare.py --pin) confines a server and every
process and thread it starts to those CPUs. Used by bench/compare.py, bench/bazel_warm.py and
tests/bench/test_quick_bench.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
BUILDGRID_VENV = BENCH / ".venv-buildgrid"  # the 0.4.4 line: the newest release for Python 3.11
BUILDGRID_09_VENV = BENCH / ".venv-buildgrid-0.9"  # the current line: needs Python >= 3.13
READY_PREFIX = "buildvault ready:"  # buildvault.logs.READY_PREFIX: the first banner line
_READY_GRPC = re.compile(r"grpc=(\S+)")


class ServerError(RuntimeError):
    pass


@dataclass
class Server:
    name: str
    address: str  # host:port of the gRPC listener
    process: subprocess.Popen[bytes]
    log_path: Path
    data_dir: Path
    # Processes this server needs and stop() ends after it (the S3 test server of a bucket run).
    companions: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, limit: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except FileNotFoundError:
            return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """A Popen preexec_fn that confines the child (and all it starts) to `cpus`; None: no limit."""
    if not cpus:
        return None
    chosen = set(cpus)
    return lambda: os.sched_setaffinity(0, chosen)


def _spawn(
    argv: list[str], log_path: Path, cwd: Path, env: dict[str, str] | None = None, cpus: set[int] | None = None
) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, preexec_fn=pinned(cpus),
        )


def buildvault_command() -> list[str]:
    script = Path(sys.executable).parent / "buildvault"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from buildvault.cli import main; sys.exit(main())"]


def start_buildvault(
    data_dir: Path, log_path: Path, extra: list[str] | None = None, timeout: float = 60.0,
    cpus: set[int] | None = None,
) -> Server:
    """`buildvault serve --grpc-address 127.0.0.1:0 --http-address '' --dir D --max-size 20GiB`.

    Waits for the banner's first line, `buildvault ready: grpc=HOST:PORT ...`, in the log.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = buildvault_command() + [
        "serve", "--grpc-address", "127.0.0.1:0", "--http-address", "", "--dir", str(data_dir),
        "--max-size", "20GiB", *(extra or []),
    ]
    process = _spawn(argv, log_path, ROOT, cpus=cpus)
    server = Server("buildvault", "", process, log_path, data_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in server.log_tail(1 << 20).splitlines():
            if line.startswith(READY_PREFIX):
                match = _READY_GRPC.search(line)
                if not match:
                    stop(server)
                    raise ServerError(f"buildvault ready line has no grpc= address: {line!r}")
                server.address = match.group(1)
                return server
        if process.poll() is not None:
            raise ServerError(f"buildvault exited with {process.returncode} before ready:\n{server.log_tail()}")
        time.sleep(0.05)
    stop(server)
    raise ServerError(f"buildvault not ready after {timeout:.0f} s:\n{server.log_tail()}")


def start_floor(mode: str, log_path: Path, timeout: float = 30.0) -> Server:
    """bench/floor_server.py: the call shapes answered from memory, on grpc.aio or the thread-pool server."""
    port = free_port()
    argv = [sys.executable, str(BENCH / "floor_server.py"), "--mode", mode, "--port", str(port)]
    process = _spawn(argv, log_path, ROOT)
    server = Server(f"floor-{mode}", f"127.0.0.1:{port}", process, log_path, log_path.parent)
    try:
        wait_grpc_ready(server.address, timeout, process)
    except ServerError:
        stop(server)
        raise
    return server


# Fake credentials for the S3 test server (moto accepts any); no profile or metadata lookups.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true",
}  # fmt: skip


def start_buildvault_on_bucket(
    data_dir: Path, log_path: Path, extra: list[str] | None = None, timeout: float = 60.0,
    cpus: set[int] | None = None,
) -> Server:
    """buildvault with the object-store tier on: `moto_server` (the S3 test server) on loopback,
    one fresh bucket, and `start_buildvault` pointed at it. stop() ends both."""
    import boto3  # the benchmark venv has the test extras

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    moto = _spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                  log_path.with_suffix(".moto.log"), ROOT, env={**os.environ, **S3_ENV}, cpus=cpus)  # fmt: skip
    session = boto3.session.Session(region_name="us-east-1", aws_access_key_id="bench", aws_secret_access_key="bench")
    client = session.client("s3", endpoint_url=endpoint)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.create_bucket(Bucket="bench")
            break
        except Exception:  # not listening yet
            if moto.poll() is not None or time.monotonic() > deadline:
                moto.kill()
                raise ServerError(f"moto_server did not start on port {port}") from None
            time.sleep(0.1)
    old = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)  # inherited by the server: the standard credential chain finds them
    try:
        server = start_buildvault(
            data_dir, log_path,
            ["--s3-endpoint", endpoint, "--s3-bucket", "bench", "--s3-region", "us-east-1", *(extra or [])],
            timeout=timeout, cpus=cpus,
        )
    except BaseException:
        moto.kill()
        raise
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    server.name = "buildvault+s3"
    server.companions.append(moto)
    return server


def buildgrid_config(address: str, data_dir: Path, line: str = "0.4") -> str:
    """Disk CAS + an ActionCache kept in that CAS (BuildGrid's LRU cache of refs, no database).

    0.4.4: thread-pool-size is also gRPC's maximum_concurrent_rpcs: the default (5 x cores = 10
    here) answers RESOURCE_EXHAUSTED to a 16-way client, so it is raised.
    0.9.x ("0.9"): the same shape; the concurrency limit is its own key (32, twice the harness's
    widest fan-out) and SO_REUSEPORT is off, so a lingering server can never share the port.
    """
    tuning = "thread-pool-size: 64"
    if line == "0.9":
        tuning = "thread-pool-size: 64\nmaximum-concurrent-rpcs: 32\ngrpc-server-options:\n  grpc.so_reuseport: 0"
    return textwrap.dedent(
        f"""\
        description: buildvault benchmark baseline (disk CAS + AC, no auth, no monitoring)
        server:
          - !channel
            address: "{address}"
            insecure-mode: true
        authorization:
          method: none
        monitoring:
          enabled: false
        TUNING
        storages:
          - !disk-storage &cas
            path: {data_dir / "cas"}
        caches:
          - !lru-action-cache &ac
            storage: *cas
            max-cached-refs: 1000000
            allow-updates: true
            cache-failed-actions: true
        instances:
          - name: ""
            services:
              - !action-cache
                cache: *ac
              - !cas
                storage: *cas
              - !bytestream
                storage: *cas
        """
    ).replace("TUNING", tuning)  # after dedent: the tuning lines start at column 0


def buildgrid_bgd(venv: Path = BUILDGRID_VENV) -> Path:
    return venv / "bin" / "bgd"


def start_buildgrid(
    data_dir: Path, log_path: Path, venv: Path = BUILDGRID_VENV, timeout: float = 60.0, line: str = "0.4",
    name: str = "buildgrid", cpus: set[int] | None = None,
) -> Server:
    bgd = buildgrid_bgd(venv)
    if not bgd.exists():
        raise ServerError(f"BuildGrid is not installed in {venv} (bench/compare.py installs it)")
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "cas").mkdir(exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    config = data_dir / "buildgrid.yml"
    config.write_text(buildgrid_config(address, data_dir, line), encoding="utf-8")
    process = _spawn([str(bgd), "server", "start", str(config)], log_path, data_dir, cpus=cpus)
    server = Server(name, address, process, log_path, data_dir)
    try:
        wait_grpc_ready(address, timeout, process)
    except ServerError as exc:
        stop(server)
        raise ServerError(f"{exc}\n{server.log_tail()}") from None
    return server


def start_buildgrid_09(
    data_dir: Path, log_path: Path, timeout: float = 60.0, cpus: set[int] | None = None
) -> Server:
    """BuildGrid 0.9.x from its own venv (bench/compare.py makes it with a Python 3.13)."""
    return start_buildgrid(data_dir, log_path, BUILDGRID_09_VENV, timeout, line="0.9", name="buildgrid-0.9", cpus=cpus)


def wait_grpc_ready(address: str, timeout: float, process: subprocess.Popen[bytes] | None = None) -> None:
    """Until GetCapabilities answers."""
    import grpc

    from buildvault.remote_apis import re_grpc, re_pb2

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = re_grpc.CapabilitiesStub(channel)
        while True:
            try:
                stub.GetCapabilities(re_pb2.GetCapabilitiesRequest(), timeout=2)
                return
            except grpc.RpcError as exc:
                if process is not None and process.poll() is not None:
                    raise ServerError(f"server exited with {process.returncode}") from None
                if time.monotonic() >= deadline:
                    raise ServerError(f"{address} not ready after {timeout:.0f} s: {exc}") from None
                time.sleep(0.2)


def stop(server: Server, timeout: float = 20.0) -> None:
    """SIGTERM the server's own process group, SIGKILL it if it lingers."""
    process = server.process
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    # children of BuildGrid left in the group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for companion in server.companions:
        if companion.poll() is None:
            companion.terminate()
            try:
                companion.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                companion.kill()
                companion.wait(timeout=10)


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
