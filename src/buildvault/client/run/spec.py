"""The options of `buildvault run` and the StepSpec they describe.

Configuration comes from the same variables as buildvault-cc (BUILDVAULT_REMOTE,
BUILDVAULT_INSTANCE, BUILDVAULT_WRITER, BUILDVAULT_TIMEOUT, BUILDVAULT_ROOTS,
BUILDVAULT_EVENT_LOG); flags override them.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    import types
    from collections.abc import Mapping

DEFAULT_EXCLUDES = (".git", "__pycache__", "*.pyc", "*.log", "*.tmp")
# How long an identical step running elsewhere on this machine is waited for before this one runs uncached.
DEFAULT_LOCK_TIMEOUT = 600.0


class SpecError(ValueError):
    """The options do not describe a step (message says which option and why)."""


class StepSpec:
    """One step as its options describe it. A plain class, not a dataclass: importing dataclasses
    costs every `buildvault run` front ~20 ms. `as_dict()` gives keyword arguments that rebuild it."""

    FIELDS = (
        "argv",
        "workdir",
        "name",
        "inputs",
        "excludes",
        "recipe_files",
        "recipe_values",
        "env",
        "tools",
        "toolchain_files",
        "platform",
        "roots",
        "outputs",
        "output_dir",
        "remote",
        "instance",
        "writer",
        "timeout",
        "lock_timeout",
        "event_log",
        "disabled",
    )

    def __init__(
        self,
        argv: list[str],
        workdir: str,
        name: str = "",
        inputs: list[str] | None = None,
        excludes: list[str] | None = None,
        recipe_files: list[str] | None = None,
        recipe_values: list[str] | None = None,
        env: list[tuple[str, str]] | None = None,
        tools: list[str] | None = None,
        toolchain_files: list[str] | None = None,
        platform: list[tuple[str, str]] | None = None,
        roots: list[str] | None = None,
        outputs: list[str] | None = None,
        output_dir: str | None = None,
        remote: str = "",
        instance: str = "",
        writer: bool = False,
        timeout: float = 5.0,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        event_log: str = "",
        disabled: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.workdir = workdir
        self.name = name
        self.inputs = list(inputs or [])
        self.excludes = list(DEFAULT_EXCLUDES) if excludes is None else list(excludes)
        self.recipe_files = list(recipe_files or [])
        self.recipe_values = list(recipe_values or [])
        self.env = [(k, v) for k, v in env or []]
        self.tools = list(tools or [])
        self.toolchain_files = list(toolchain_files or [])
        self.platform = [(k, v) for k, v in platform or []]
        self.roots = list(roots or [])  # --normalize-root values: DIR or NAME=DIR
        self.outputs = list(outputs or [])
        self.output_dir = output_dir
        self.remote = remote
        self.instance = instance
        self.writer = writer
        self.timeout = timeout
        self.lock_timeout = lock_timeout
        self.event_log = event_log
        self.disabled = disabled

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.FIELDS}

    def __repr__(self) -> str:
        return f"StepSpec({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"

    @property
    def label(self) -> str:
        return self.name or os.path.basename(self.argv[0])


def parse_platform(text: str) -> list[tuple[str, str]]:
    """`soc=ascend910b1,cann=8.0.RC3` -> [(name, value)]; every item must be NAME=VALUE."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise SpecError(f"--platform {item!r}: want NAME=VALUE")
        out.append((name.strip(), value.strip()))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    import argparse  # here: the per-step front usually needs no argparse (quick_args.py)

    a = parser.add_argument
    a("--name", default="", help="step name on the status line and in the event log (default: the command)")
    a("--input", action="append", default=[], metavar="PATH", help="input file or directory (repeatable)")
    a(
        "--exclude",
        action="append",
        default=None,
        metavar="GLOB",
        help=f"left out when walking input directories (repeatable; default: {' '.join(DEFAULT_EXCLUDES)})",
    )
    a("--recipe-file", action="append", default=[], metavar="PATH", help="script or options file of the recipe")
    a("--recipe-value", action="append", default=[], metavar="TEXT", help="a recipe value that joins the key")
    a("--env", action="append", default=[], metavar="NAME=VALUE", help="set for the command and part of the key")
    a("--tool", action="append", default=[], metavar="NAME", help="tool on PATH whose --version output joins the key")
    a("--toolchain-file", action="append", default=[], metavar="PATH", help="toolchain file hashed into the key")
    a(
        "--platform",
        action="append",
        default=[],
        metavar="NAME=VALUE,...",
        help="platform properties (soc=...,cann=...)",
    )
    a(
        "--normalize-root",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="another root replaced by a placeholder in the key (the source and build roots always are)",
    )
    a("--workdir", default=None, metavar="DIR", help="where the command runs (default: the current directory)")
    a("--output", action="append", default=[], metavar="PATH", help="output file or directory (repeatable)")
    a("--output-dir", default=None, metavar="DIR", help="outputs: what the command creates or changes in DIR")
    a("--remote", default=None, help="grpc://host:port (default: BUILDVAULT_REMOTE)")
    a("--instance", default=None, help="REAPI instance name (default: BUILDVAULT_INSTANCE)")
    a(
        "--writer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store results on a miss (default: BUILDVAULT_WRITER=1)",
    )
    a(
        "--lock-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"wait this long for an identical step on this machine (default {DEFAULT_LOCK_TIMEOUT:g})",
    )
    a("step_command", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments")


def spec_from_args(args: argparse.Namespace | types.SimpleNamespace, env: Mapping[str, str], cwd: str) -> StepSpec:
    argv = list(args.step_command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise SpecError("no command: buildvault run [options] -- CMD ARGS...")
    workdir = os.path.abspath(os.path.join(cwd, args.workdir or "."))
    if not os.path.isdir(workdir):
        raise SpecError(f"--workdir {args.workdir}: not a directory")
    if not args.output and not args.output_dir:
        raise SpecError("no outputs: give --output PATH or --output-dir DIR")
    if args.output and args.output_dir:
        raise SpecError("give --output or --output-dir, not both")
    pairs = []
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SpecError(f"--env {item!r}: want NAME=VALUE")
        pairs.append((name, value))
    platform = [p for text in args.platform for p in parse_platform(text)]
    timeout_text = env.get("BUILDVAULT_TIMEOUT", "") or "5"
    try:
        timeout = float(timeout_text)
    except ValueError:
        raise SpecError(f"BUILDVAULT_TIMEOUT={timeout_text!r}: want seconds") from None
    writer = args.writer if args.writer is not None else env.get("BUILDVAULT_WRITER", "") in ("1", "true", "yes")
    return StepSpec(
        argv=argv,
        workdir=workdir,
        name=args.name,
        inputs=[os.path.join(workdir, p) for p in args.input],
        excludes=list(DEFAULT_EXCLUDES) if args.exclude is None else list(args.exclude),
        recipe_files=[os.path.join(workdir, p) for p in args.recipe_file],
        recipe_values=list(args.recipe_value),
        env=pairs,
        tools=list(args.tool),
        toolchain_files=[os.path.join(workdir, p) for p in args.toolchain_file],
        platform=platform,
        roots=list(args.normalize_root),
        outputs=[os.path.normpath(os.path.join(workdir, p)) for p in args.output],
        output_dir=os.path.normpath(os.path.join(workdir, args.output_dir)) if args.output_dir else None,
        remote=args.remote if args.remote is not None else env.get("BUILDVAULT_REMOTE", ""),
        instance=args.instance if args.instance is not None else env.get("BUILDVAULT_INSTANCE", ""),
        writer=writer,
        timeout=timeout,
        lock_timeout=args.lock_timeout if args.lock_timeout is not None else DEFAULT_LOCK_TIMEOUT,
        event_log=env.get("BUILDVAULT_EVENT_LOG", ""),
        disabled=env.get("BUILDVAULT_DISABLE", "") in ("1", "true"),
    )
