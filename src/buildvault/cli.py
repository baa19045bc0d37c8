"""The `buildvault` command.

    buildvault serve [--config FILE] [--dir DIR] [--max-size SIZE] [--grpc-address HOST:PORT] ...
    buildvault run [options] -- CMD ...      one build step through the cache (client/run/)
    buildvault cmake-module-path             where buildvault.cmake is
    buildvault artifact push|pull|pin|unpin|pins ...   whole-build artifacts, golden versions
    buildvault asset fetch|push|pin|unpin|pins ...   external downloads (Remote Asset), golden versions

Every Settings field is a flag, generated from the field's metadata (parser, help, metavar),
so flags, BUILDVAULT_<NAME> variables and TOML keys can never drift apart. Precedence:
flags > environment > config file > defaults.

SIGTERM or SIGINT stops the server cleanly: it stops accepting, lets in-flight requests
(uploads included) finish for up to the grace period, then cancels what is left; a cancelled
upload publishes nothing. A second signal cuts the grace period short.
"""

from __future__ import annotations

import os
import sys

# asyncio, logs and config load on use: `buildvault run` is started once per build step.
TYPE_CHECKING = False  # no `import typing` at run time: `buildvault run` starts once per build step
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence
    from typing import Any

    from buildvault.config import Settings

# Seconds in-flight requests get to finish after SIGTERM/SIGINT.
SHUTDOWN_GRACE = 20.0


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_settings_flags(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """One flag per Settings field (whose name starts with `prefix`); unset flags stay None so
    lower layers show through."""
    from buildvault.config import ENV_PREFIX, Settings

    for f in Settings.fields():
        if not f.name.startswith(prefix):
            continue
        help_text = f.metadata.get("help", "")
        default = f.default
        if f.name == "dir":
            shown = "the user cache dir"
        elif default == ():
            shown = "none"
        elif isinstance(default, bool) or default in ("", None):
            shown = repr(default) if default != "" else "empty"
        else:
            shown = str(default)
        help_text = f"{help_text} (env {ENV_PREFIX}{f.name.upper()}; default: {shown})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
        if isinstance(default, tuple):  # repeatable: each use adds one value
            kwargs["action"] = "append"
        if isinstance(default, bool):
            # `--s3-read-only` alone means true; `--s3-read-only false` is explicit.
            kwargs.update(nargs="?", const="true")
        parser.add_argument(_flag(f.name), **kwargs)


def version() -> str:
    """The installed distribution's version (pyproject.toml's, recorded at install time)."""
    import importlib.metadata

    return importlib.metadata.version("buildvault")


def build_parser() -> argparse.ArgumentParser:
    import argparse
    parser = argparse.ArgumentParser(
        prog="buildvault", description="Remote build cache for Bazel and REAPI v2 clients."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    from buildvault.config import ENV_PREFIX

    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the cache server",
        description=(
            "Run the cache server. Precedence: flags > BUILDVAULT_<NAME> environment > --config file > defaults."
        ),
    )
    serve.add_argument(
        "--config", metavar="FILE", default=None, help=f"TOML settings file (env {ENV_PREFIX}CONFIG)"
    )
    add_settings_flags(serve)
    from buildvault.client.run.command import add_run_parser

    add_run_parser(commands)
    from buildvault.client.run.artifact_cli import add_artifact_parser

    add_artifact_parser(commands)
    from buildvault.client.asset import add_asset_parser  # Remote Asset outside Bazel (issue 34)

    add_asset_parser(commands)
    from buildvault.server.auth.tokens import add_token_parser  # auth (issue 11)

    add_token_parser(commands)
    from buildvault.server.auth.audit import add_audit_parser  # the write audit trail (issue 36)

    add_audit_parser(commands)
    # remote execution (issue 12): a worker on any machine, fed by the Redis queue
    worker = commands.add_parser(
        "worker",
        help="run remote-execution jobs from a Redis queue",
        description="Run jobs from `buildvault serve --queue redis://...`; inputs and outputs go through the "
        "server's gRPC CAS only.",
    )
    worker.add_argument("--server", required=True, metavar="grpc://HOST:PORT", help="the server (its CAS)")
    worker.add_argument("--queue", required=True, metavar="redis://HOST:PORT/DB", help="the server's --queue")
    worker.add_argument("--platform", default="", metavar="KEY=VALUE,...", help="properties this worker offers")
    worker.add_argument("--concurrency", type=int, default=1, metavar="N", help="jobs at once (default 1)")
    worker.add_argument("--work-dir", default="buildvault-worker", metavar="DIR", help="action directories")
    worker.add_argument("--sandbox", default="auto", choices=("auto", "bwrap", "none"))
    worker.add_argument("--name", default="", help="worker name (default: host and properties)")
    worker.add_argument("--lease", type=float, default=30.0, metavar="SECONDS",
                        help="a job pending this long without its worker's heartbeat is taken back")  # fmt: skip
    health = commands.add_parser(
        "healthcheck",
        help="exit 0 if the local server's /healthz answers (the container HEALTHCHECK)",
        description="GET /healthz on the server's HTTP address (settings as for serve; wildcard host: loopback).",
    )
    health.add_argument(
        "--config", metavar="FILE", default=None, help=f"TOML settings file (env {ENV_PREFIX}CONFIG)"
    )
    health.add_argument("--http-address", dest="http_address", metavar="HOST:PORT", default=None)
    _add_admin_commands(commands)
    return parser


def _add_admin_commands(commands: Any) -> None:
    status = commands.add_parser("status", help="size, cap, hit ratio and upload backlog of a running server")
    status.add_argument("--server", default="http://127.0.0.1:8080", metavar="URL", help="the server's HTTP URL")
    status.add_argument("--json", action="store_true", help="one JSON object on stdout")
    verify = commands.add_parser(
        "verify",
        help="re-hash every stored blob and check every action entry of a data directory",
        description="Safe while the server runs. Exit 0: all intact (or repaired), 1: problems found, 2: bad --dir.",
    )
    verify.add_argument("--dir", required=True, metavar="DIR", help="the server's data directory")
    verify.add_argument("--repair", action="store_true", help="remove corrupt blobs and broken or dangling entries")
    verify.add_argument("--json", action="store_true", help="one JSON object on stdout")
    from buildvault.config import ENV_PREFIX

    verify.add_argument(
        "--config", metavar="FILE", default=None, help=f"TOML settings file (env {ENV_PREFIX}CONFIG)"
    )
    add_settings_flags(verify, prefix="s3_")  # with a bucket, --repair refetches damaged blobs from it

    gc = commands.add_parser(
        "gc",
        help="delete old action entries and unreferenced blobs from the S3 bucket",
        description="Deletes expired action entries first, then blobs no remaining entry references.",
    )
    gc.add_argument(
        "--config", metavar="FILE", default=None, help=f"TOML settings file (env {ENV_PREFIX}CONFIG)"
    )
    add_settings_flags(gc, prefix="s3_")
    gc.add_argument("--max-age", metavar="AGE", default=None, help="delete action entries unused this long (30d)")
    gc.add_argument("--max-size", metavar="SIZE", default=None, help="delete unreferenced blobs until under SIZE")
    gc.add_argument("--grace", metavar="AGE", default="1h", help="never delete blobs younger than this (default 1h)")
    gc.add_argument("--dry-run", action="store_true", help="delete nothing; report what would go")
    gc.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _run_admin(args: argparse.Namespace) -> int:
    if args.command == "status":
        from buildvault.admin import status

        return status.run(args.server, args.json)
    from buildvault.config import ConfigError

    try:
        settings = settings_from_args(args)
    except ConfigError as e:
        print(f"buildvault {args.command}: {e}", file=sys.stderr)
        return 2
    if args.command == "verify":
        from buildvault.admin import verify

        return verify.run(args.dir, args.repair, args.json, settings)
    from buildvault.admin import gc

    return gc.run(settings, args.max_age, args.max_size, args.grace, args.dry_run, args.json)


def settings_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> Settings:
    from buildvault.config import Settings, load_settings

    flags = {f.name: getattr(args, f.name, None) for f in Settings.fields()}
    return load_settings(flags, os.environ if env is None else env, args.config)


async def serve(settings: Settings, grace: float = SHUTDOWN_GRACE) -> int:
    import asyncio
    import signal

    from buildvault import logs
    from buildvault.server.app import App, StartupError

    app = App(settings)
    stop = asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            hurry.set()
        else:
            logs.banner([f"buildvault: {signal.Signals(signum).name}, shutting down (grace {grace:g}s)"])
            stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    # auth (issue 11): SIGHUP rereads certificates and the htpasswd, token and access files.
    reloads: set[asyncio.Task[Any]] = set()

    def on_reload() -> None:
        task = asyncio.ensure_future(app.reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_reload)
    try:
        try:
            await app.start()
        except (StartupError, OSError) as e:
            print(f"buildvault: {e}", file=sys.stderr)
            return 1
        await stop.wait()
        stopping = asyncio.ensure_future(app.stop(grace))
        hurried = asyncio.ensure_future(hurry.wait())
        await asyncio.wait({stopping, hurried}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():
            # Second signal: cancel what is still in flight now (nothing half-published).
            await app.hurry()
            await stopping
        hurried.cancel()
        logs.banner(["buildvault: stopped"])
        return 0
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["run"]:  # the per-step path: no server modules, no settings
        from buildvault.client.run.command import run_main

        return run_main(words[1:])
    import asyncio

    from buildvault import logs
    from buildvault.config import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        from buildvault.client.run.command import main_run

        return main_run(args)
    if args.command == "artifact":
        from buildvault.client.run.artifact import main_artifact

        return main_artifact(args)
    if args.command == "asset":
        from buildvault.client.asset import main_asset

        return main_asset(args)
    if args.command == "cmake-module-path":
        from buildvault.client.run.command import main_cmake_module_path

        return main_cmake_module_path()
    if args.command == "token":
        from buildvault.server.auth.tokens import add_token_command

        return add_token_command(args)
    if args.command == "audit":
        from buildvault.server.auth.audit import audit_command

        return audit_command(args)
    if args.command == "worker":  # remote execution (issue 12)
        from buildvault.execution.redis.worker import run_worker

        return run_worker(args)
    if args.command in ("status", "verify", "gc"):
        return _run_admin(args)
    if args.command not in ("serve", "healthcheck"):
        parser.print_help(sys.stderr)
        return 2
    try:
        settings = settings_from_args(args)
    except ConfigError as e:
        print(f"buildvault: {e}", file=sys.stderr)
        return 2
    if args.command == "healthcheck":
        from buildvault.admin import healthcheck

        return healthcheck.run(settings.http_address)
    from buildvault.server.heap_trim import configure_malloc

    logs.configure(settings.log_level, fmt=settings.log_format)
    configure_malloc()  # before any server thread exists
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
