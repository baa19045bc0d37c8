"""The `buildvault` command.

    buildvault serve [--config FILE] [--dir DIR] [--max-size SIZE] [--grpc-address HOST:PORT] ...

Every Settings field is a flag, generated from the field's metadata (parser, help, metavar),
so flags, BUILDVAULT_<NAME> variables and TOML keys can never drift apart. Precedence:
flags > environment > config file > defaults.

SIGTERM or SIGINT stops the server cleanly: it stops accepting, lets in-flight requests
(uploads included) finish for up to the grace period, then cancels what is left; a cancelled
upload publishes nothing. A second signal cuts the grace period short.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from buildvault import logs
from buildvault.config import ENV_PREFIX, ConfigError, Settings, load_settings

# Seconds in-flight requests get to finish after SIGTERM/SIGINT.
SHUTDOWN_GRACE = 20.0


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field; unset flags stay None so lower layers show through."""
    for f in Settings.fields():
        help_text = f.metadata.get("help", "")
        default = f.default
        if f.name == "dir":
            shown = "the user cache dir"
        elif isinstance(default, bool) or default in ("", None):
            shown = repr(default) if default != "" else "empty"
        else:
            shown = str(default)
        help_text = f"{help_text} (env {ENV_PREFIX}{f.name.upper()}; default: {shown})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
        if isinstance(default, bool):
            # `--s3-read-only` alone means true; `--s3-read-only false` is explicit.
            kwargs.update(nargs="?", const="true")
        parser.add_argument(_flag(f.name), **kwargs)


def version() -> str:
    """The installed distribution's version (pyproject.toml's, recorded at install time)."""
    return importlib.metadata.version("buildvault")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="buildvault", description="Remote build cache for Bazel and REAPI v2 clients."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
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
    health = commands.add_parser(
        "healthcheck",
        help="exit 0 if the local server's /healthz answers (the container HEALTHCHECK)",
        description="GET /healthz on the server's HTTP address (settings as for serve; wildcard host: loopback).",
    )
    health.add_argument(
        "--config", metavar="FILE", default=None, help=f"TOML settings file (env {ENV_PREFIX}CONFIG)"
    )
    health.add_argument("--http-address", dest="http_address", metavar="HOST:PORT", default=None)
    return parser


def settings_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> Settings:
    flags = {f.name: getattr(args, f.name, None) for f in Settings.fields()}
    return load_settings(flags, os.environ if env is None else env, args.config)


async def serve(settings: Settings, grace: float = SHUTDOWN_GRACE) -> int:
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
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    logs.configure(settings.log_level, fmt=settings.log_format)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
